"""`tqserve route`: a prefix-aware data-parallel router in front of N tqserve servers.

core (sans-io routing), backends (links to the servers, health checks), service (the
running router), ws / http (the front ends), app (quart-trio + hypercorn), metrics, cli.
"""
