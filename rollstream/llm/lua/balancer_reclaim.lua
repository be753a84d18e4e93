-- Give back the slots of expired leases (their worker died). Any process may run it.
-- KEYS: backends, backends:down, leases, leases:backend
-- ARGV: maximum number of leases to reclaim
-- Returns the number of leases reclaimed.
return reclaim(KEYS[1], KEYS[2], KEYS[3], KEYS[4], now_ms(), tonumber(ARGV[1]))
