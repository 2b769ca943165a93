"""Where arrays live: device meshes (``mesh``), the logical-axis rules that map a model's
axis names onto mesh axes (``rules``), placing models and constraining activations by
those rules (``sharding``), mesh-axis arithmetic for per-device programs (``axes``), and
the multi-process runtime (``runtime``)."""
