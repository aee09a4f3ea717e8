"""Constants shared by attnx.data (which writes them) and attnx.train (which reads them).

A module without imports, so that the datasets (numpy/TFDS only) and the training code (JAX)
refer to one definition without importing each other.
"""

# Target value that losses and metrics skip (padding, non-query positions); the Zoology /
# PyTorch convention, so datasets ported from there need no relabelling.
IGNORE_INDEX = -100
