-- Shared helpers of the backend balancer; balancer.py prepends this file to every
-- balancer_*.lua script, so each script stays one atomic step on the same key layout.
-- Key layout (named in pipeline/keys.py, all prefixed by the namespace):
--   {ns}:backends        ZSET  healthy backend url -> requests in flight (the min-heap)
--   {ns}:backends:down   ZSET  ejected backend url -> requests still in flight there
--   {ns}:leases          ZSET  lease id -> expiry (ms, Redis server clock)
--   {ns}:leases:backend  HASH  lease id -> backend url

-- The Redis server clock, so workers with skewed clocks agree on lease expiry.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Give the slot a lease holds back to its backend. Unknown leases are a no-op, so a late
-- release after a reclaim (or a double release) never counts twice.
local function give_back(up_key, down_key, leases_key, lease_backend_key, lease)
  local backend = redis.call('HGET', lease_backend_key, lease)
  if not backend then
    redis.call('ZREM', leases_key, lease)
    return 0
  end
  redis.call('HDEL', lease_backend_key, lease)
  redis.call('ZREM', leases_key, lease)
  -- ZINCRBY would create a removed backend again, so only touch a member that exists.
  for _, key in ipairs({up_key, down_key}) do
    local score = redis.call('ZSCORE', key, backend)
    if score then
      if tonumber(score) > 0 then
        redis.call('ZINCRBY', key, -1, backend)
      end
      return 1
    end
  end
  return 1
end

-- Give back the slots of leases whose holder stopped renewing them (a dead worker).
local function reclaim(up_key, down_key, leases_key, lease_backend_key, now, limit)
  local expired = redis.call('ZRANGEBYSCORE', leases_key, '-inf', now, 'LIMIT', 0, limit)
  for _, lease in ipairs(expired) do
    give_back(up_key, down_key, leases_key, lease_backend_key, lease)
  end
  return #expired
end
