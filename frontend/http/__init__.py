"""The HTTP app on top: the route table, the process, middleware (auth, limits), readiness,
/metrics and /openapi.json.
"""
