"""Process mesh, collectives and sharding bounds."""
