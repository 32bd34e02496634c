"""What every room below the strategy shares: batch conventions, the collective helpers and their one recorder,
the precision table and check tolerance, the global loss, token metrics and the sharded = unsharded comparison."""
