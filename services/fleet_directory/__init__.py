"""The fleet's block directory as stored in Redis, below the services that share it: the KV manager
writes it (services.kvmanager.directory), schedulers read it at a cold start (snapshot)."""
