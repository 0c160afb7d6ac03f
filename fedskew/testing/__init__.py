"""Real Flower processes for the tests and benchmarks: a simulation SuperLink of our own (launch.py) and a
TLS deployment on this host (deploy.py). Not part of the app: the FAB a site downloads leaves this package out
(pyproject fab-exclude)."""
