"""A cluster of simulated hosts on one Linux machine (docs/17-many-hosts.md).

network.py builds the hosts (network namespaces) and their links (veth pairs, bridges,
tc token buckets); control.py brings a cluster up and down and keeps its record;
launch.py runs an MPI job across its hosts; __main__.py is the command line.
"""
