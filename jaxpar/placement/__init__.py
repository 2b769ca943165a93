"""Where arrays live: device meshes (``mesh``), the logical-axis rules that map a model's
axis names onto mesh axes (``rules``), placing models and constraining activations by
those rules (``sharding`` for NNX, ``linen`` for Linen), what the rules do to a model's
parameters (``report``, as ``jaxpar.rules.explain``), mesh-axis arithmetic for
per-device programs (``axes``), and the multi-process runtime (``runtime``)."""
