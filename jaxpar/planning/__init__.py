"""Automatic parallel planning (Colossal-Auto, Alpa): every layout of a training step
on N devices, ranked by predicted step time among those that fit the device's memory.

* ``layout``    the candidates (mesh, pipeline schedule, sequence parallelism, remat,
                gradient accumulation, offload), their bounds and pruning rules;
* ``workload``  the model and batch, and exact per-device parameter shards on a mesh
                of any size;
* ``memory``    the analytic memory model, by part;
* ``cost``      the step-time model: compute, exposed communication, bubble, offload;
* ``hardware``  hardware profiles (``h100``, ``h200``, ``a100``, a calibrated ``cpu``);
* ``calibrate`` measures the ``cpu`` profile on this machine;
* ``cache``     compiled figures on disk, by model shape and layout;
* ``search``    the ranking, compiling every candidate that could rank first for exact
                figures (its margins: ``TIME_MARGIN``, ``MEMORY_LOW``, ``MEMORY_HIGH``);
* ``advice``    the line that says when the question is wrong, and what would help;
* ``devices``   device profiles: each pipeline rank's relative speed and memory;
* ``stages``    ``pipeline.stage_layers=auto``: layers per rank from a device profile,
                and the step time of any split, the schedule played tick by tick.

``jaxpar-plan`` and ``mesh=auto`` (``jaxpar.train.plan``) build the train step each
compiled candidate runs; this package sees shapes, layouts and figures.
"""
