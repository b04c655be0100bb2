"""The command line: the ``edge-queue`` command (``launch``, ``main``), ``doctor``, and how ``--help`` names values.

Empty on purpose: ``cli.launch`` sets its Ctrl-C handler before anything else is imported."""
