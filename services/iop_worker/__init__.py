"""The IOP worker: OpenAI Files and Batch APIs over the platform.

    store.JobStore (Protocol)  <-  sqlite_store.SqliteJobStore   (default: a file in the state folder)
                               <-  pg_store.PgJobStore           (store: {url: postgresql://...}, many machines)

Files, batches and their input lines live in the job store; workers lease lines, run them and
finish them there, so a worker killed at any moment loses nothing and doubles nothing.
"""

from __future__ import annotations
