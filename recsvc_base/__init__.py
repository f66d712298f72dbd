"""What every package of the project stands on and nothing of the project's: the user's errors (``errors.py``)
and the progress output (``progress.py``). ``tokenizer_rqvae``, ``recsvc`` and ``training`` import it; it imports
none of them."""
