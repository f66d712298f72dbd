"""Start-up: one ``recsvc serve`` process from its flags to its exit (``process``), the parent of ``--processes
N`` (``workers``), the served engine's flags, settings and one constructor (``settings``), the ``--spec auto``
calibration and the choice kept in the bundle (``calibration``, ``calibration_cache``), and the model-free
popularity recommender served with ``--popularity`` (``popularity``)."""
