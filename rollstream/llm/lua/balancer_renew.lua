-- Push the expiry of live leases forward; the holder calls it well inside the ttl.
-- KEYS: backends, backends:down, leases, leases:backend
-- ARGV: lease ttl ms, lease ids
-- Returns how many leases were renewed; a lease already reclaimed is not brought back.
local expiry = now_ms() + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[4], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[3], 'XX', expiry, ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
