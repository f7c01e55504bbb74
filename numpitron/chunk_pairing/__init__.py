"""A forward and a backward chunk of a pipeline schedule run as one pair, each hiding
the other's expert all-to-alls (DeepSeek-V3 §3.2.1)."""
