"""Serving (issue 19): an engine with a paged KV cache and continuous batching.

``Engine(model, ...)`` owns the model, the pages and the requests (``engine.py``);
``Engine.generate(prompts, SamplingParams(...))`` runs an offline batch, ``add_request``
/ ``step`` / ``abort`` drive it one iteration at a time (a request's parameters, output
and state: ``requests.py``). ``scheduler.py`` decides each
step (decode rows, prompt chunks, admissions, preemption) over ``page_pool.py``'s page
ids and prefix cache; ``pages.py`` holds the paged cache on the device (``RaggedCache``
for a step's flat batch, ``PagedCache`` for a round's rows: the model's ``Cache``
interface over pages) and the one attention over pages, ``programs.py`` the compiled
programs (a step; a draft's round is ``jaxpar.inference.speculative.speculate``, the
dense decoder's);
``detokenize.py`` grows a sequence's text token by token, ``structured.py`` turns a JSON
schema into each step's token mask (llguidance, the ``structured`` extra).
``async_engine.py`` runs an engine on a thread of its own for asyncio callers
(``AsyncEngine``), ``server.py`` is the OpenAI-compatible FastAPI app ``jaxpar-serve``
runs (imported on its own: it needs fastapi), reading requests with
``openai_requests.py`` and writing responses with ``openai_responses.py``, and
``chat_template.py`` renders Hugging Face chat templates for it and for anyone else,
without the web stack.
"""

from jaxpar.serving.engine import Engine, RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
