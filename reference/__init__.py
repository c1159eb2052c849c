"""Plain single-device models: the ground truth every sharded case is compared against."""
