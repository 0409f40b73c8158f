"""The fleet: everything that runs several engines, one layer above the server.

launch.py is `hearth serve` (one server, or replicas behind a router); replicas.py and
ray_replicas.py start the replicas (each a hearth server of its own) as processes or Ray actors;
router.py is the one endpoint in front of them, routing.py how it picks a replica;
disaggregated.py makes servers prefill and decode workers and moves prompts' KV between them
(kv_route.py: the prefill worker's route as its callers, Ray actors among them, see it).
The server never imports the fleet: the fleet adds what it needs to the apps it builds.
"""
