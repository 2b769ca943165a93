"""Training jobs run on a cluster (issue 40): ``jobs`` reads and checks ``JOBS.yaml``,
``run`` runs the jobs on Ray under one of ``jaxpar.elastic``'s schedulers, each job a
``jaxpar-train`` process resized by stopping at a saved step and restarting. Beside
``jaxpar.elastic`` (the schedulers and their simulation, which import no training) and
above ``jaxpar.train`` (a job's config and its speed predicted by the planner);
``jaxpar-cluster`` (``jaxpar.commands.cluster``) is its command line. The package
imports nothing itself: Ray is the cluster extra's, loaded only when a run starts.
"""
