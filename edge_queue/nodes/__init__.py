"""Worker nodes: the hub's side (``hub``), the node's process (``node``), path maps (``pathmap``)."""
