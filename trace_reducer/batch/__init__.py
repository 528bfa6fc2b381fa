"""`reduce-all`: many bundles, local or behind URLs, in a process pool or on Ray, into tables."""

# pyarrow (the tables) and Ray are optional extras: their modules are imported where used.
from ._batch import BatchOptions, BundleResult, Outcome, reduce_one

__all__ = ["BatchOptions", "BundleResult", "Outcome", "reduce_one"]
