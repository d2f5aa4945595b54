"""`tvcache bench grpo`: a real GRPO run (TRL, SmolLM2-135M-Instruct on the CPU, text-to-SQL with a `sql` tool on
SQLite sandboxes), twice from the same seed, without and with tvcache; see `bench`."""
