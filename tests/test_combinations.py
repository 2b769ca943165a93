"""The table of feature combinations (``jaxpar.train.combinations``): the README shows it
as declared, and every refused pair is one line naming both settings, exit 2, before
any data is read, with nothing written."""

import itertools
import pathlib

import pytest

from jaxpar.train import combinations
from jaxpar.train.config import ConfigError, load_config

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# Each feature turned on by overrides of `tiny` (8 simulated devices: every pair fits).
TURN_ON = {
    "model.moe": ["model=moe_tiny"],
    "offload": ["offload.optimizer=host"],
    "data.batch_weights": ["data.batch_weights=[1]"],
    "optimizer.reduction=adasum": ["optimizer.reduction=adasum"],
    "optimizer.compression=dct_topk": ["optimizer.compression=dct_topk"],
    "eval.noise_scale": ["eval.noise_scale=true"],
    "task=glide": ["task=glide", "target_run_dir=runs/tiny"],
    "optimizer.grad_accum": ["optimizer.grad_accum=2"],
    "mesh.fsdp": ["mesh.fsdp=2"],
    "mesh.tensor": ["mesh.tensor=2"],
    "mesh.pipe": ["mesh.pipe=2"],
    "mesh.seq": ["mesh.seq=2"],
}


def test_every_feature_has_overrides_that_turn_it_on_alone():
    assert list(TURN_ON) == list(combinations.KEYS)
    for key, overrides in TURN_ON.items():
        assert list(combinations.on(load_config("tiny", overrides))) == [key], key


def test_the_readme_shows_the_table():
    text = README.read_text()
    start = text.index("<!-- combinations:")
    table = text[text.index("\n", start) + 1:text.index("<!-- end combinations -->")]
    assert table.strip() == combinations.markdown().strip()


@pytest.mark.parametrize("a, b", [tuple(sorted(pair, key=combinations.KEYS.index)) for pair in combinations.REFUSED])
def test_a_refused_pair_is_one_line_naming_both(a, b):
    with pytest.raises(ConfigError) as error:
        load_config("tiny", TURN_ON[a] + TURN_ON[b])
    line = str(error.value)
    assert "\n" not in line and line.endswith(combinations.REFUSED[frozenset((a, b))])
    shown = combinations.on(load_config("tiny", TURN_ON[a])), combinations.on(load_config("tiny", TURN_ON[b]))
    assert line.startswith(f"{shown[0][a]} with {shown[1][b]} is not supported yet: "), line


def test_the_pairs_that_work_load():
    works = [pair for pair in itertools.combinations(combinations.KEYS, 2) if frozenset(pair) not in combinations.REFUSED]
    assert len(works) + len(combinations.REFUSED) == len(combinations.KEYS) * (len(combinations.KEYS) - 1) // 2
    for a, b in works:
        assert set(combinations.on(load_config("tiny", TURN_ON[a] + TURN_ON[b]))) == {a, b}, (a, b)


def test_the_cli_exits_2_and_writes_nothing(tmp_path, capfd):
    from jaxpar.commands.train import main

    run = tmp_path / "run"
    code = main(["tiny", "data.batch_weights=[1]", "mesh.seq=2", f"run_dir={run}", "--no-progress"])
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and lines == ["jaxpar-train: error: data.batch_weights=[1.0] with mesh.seq=2 is not supported yet: "
                                   + combinations.REFUSED[frozenset(("data.batch_weights", "mesh.seq"))]], lines
    assert not run.exists()
