"""One job over several processes or machines: tensor.py (tensor parallelism under torchrun), sharding.py (one
input split across array tasks)."""
