"""Several engines behind one front end: routing policies (router.py, pure Python, which
the simulator's fleet routes with too), the data-parallel front end and its replicas on
Ray (data_parallel.py, client.py, actor.py, events.py, ray_cluster.py). Nothing here is
imported by `import iterserve`: Ray loads only when a front end needs it."""
