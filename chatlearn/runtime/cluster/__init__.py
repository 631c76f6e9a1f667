"""A run's processes on Ray: the placement plan, placement groups and worker processes, the model hosts
inside them, the stream dataset actor, joining or starting Ray, and the Ray head going away.
"""
