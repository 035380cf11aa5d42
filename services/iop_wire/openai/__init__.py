"""OpenAI's API shapes over IOP, for every service that speaks it (the edge over HTTP, the worker
for batch lines): request bodies checked and turned into run.request (:mod:`.requests`), run
events turned into OpenAI's responses and stream chunks (:mod:`.responses`), and IOP errors as
OpenAI's error objects with one HTTP status per code (:mod:`.errors`)."""
