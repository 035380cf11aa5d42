"""Real inference servers (llama-cpp-python, Ollama) and a tiny local model for the adapter tests.

Install once per machine with ``bash tests/backends/install.sh``; see servers.py and fixtures.py.
"""
