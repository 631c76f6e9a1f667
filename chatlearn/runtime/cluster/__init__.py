"""A run's processes on Ray: the placement plan, placement groups and worker processes, the model hosts
inside them, the stream dataset actor, and launching (or joining) the cluster.
"""
