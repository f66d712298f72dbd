"""The served recipe as code: typed stages (``stages.py``), the named recipes (``recipes.py``), the runner that
resumes them stage by stage (``runner.py``); ``recsvc build --recipe NAME`` runs one."""
