"""FederatedFactory (Moleri et al., arXiv:2603.16370; docs/factory.md) as plain functions.

site.py           what a site does: train its generators, audit them for memorisation, train a P2P expert
site_handlers.py  a site's replies to the server's upload, relay and validation messages
library.py        the generator library: upload validation, library files, class-balanced synthesis, grids,
                  the privacy summary of DP-SGD generators
synthesis.py      what the server makes of the library: the synthetic set, the classifier trained on it, experts saved
classifier.py     classifier training on synthetic (+ real) data (the Product of Experts: fedskew/models/ensemble.py)
run.py            FactoryRun: the settings both sides derive their plans from, in a Flower app of one's own

The server's rounds are the FederatedFactory strategy in fedskew/strategies/factory.py, the records both
sides exchange in fedskew/protocol.py, and modular unlearning of a finished run in fedskew/unlearn.py.
"""
