-- Pick a backend for one request of a job and take a lease on one in-flight slot.
-- KEYS: backends, backends:down, leases, leases:backend, lease sequence,
--       job affinity key (backend), group affinity key (set of backends; '' if none),
--       the generation-paused flag
-- ARGV: worker id, lease ttl ms, group affinity slack, affinity ttl s, reclaim batch
-- Returns {lease id, backend, reason}, {'', '', 'paused'} while generation is paused (a
-- weight sync: no turn may start), or false when no healthy backend exists.
local up, down, leases, lease_backend, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local job_key, group_key = KEYS[6], KEYS[7]
local worker, ttl_ms = ARGV[1], tonumber(ARGV[2])
local slack, affinity_ttl_s = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()

-- Any acquiring worker cleans up after dead ones, so no separate reaper is required.
reclaim(up, down, leases, lease_backend, now, tonumber(ARGV[5]))

if redis.call('EXISTS', KEYS[8]) == 1 then
  return {'', '', 'paused'}
end

local least = redis.call('ZRANGE', up, 0, 0, 'WITHSCORES')
if #least == 0 then
  return false
end
local min_backend, min_load = least[1], tonumber(least[2])

local chosen, reason = nil, 'least_loaded'
-- A job keeps its backend across turns: its whole history is in that backend's KV cache.
local sticky = redis.call('GET', job_key)
if sticky and redis.call('ZSCORE', up, sticky) then
  chosen, reason = sticky, 'job'
end

if group_key ~= '' then
  -- The group's shared prompt is cached on every backend its jobs went to: take the least
  -- loaded of those while it stays within the slack of the global minimum.
  local best, best_load = nil, nil
  for _, backend in ipairs(redis.call('SMEMBERS', group_key)) do
    local load = redis.call('ZSCORE', up, backend)
    if load then
      load = tonumber(load)
      if not best_load or load < best_load or (load == best_load and backend < best) then
        best, best_load = backend, load
      end
    else
      redis.call('SREM', group_key, backend)  -- ejected or removed: forget it
    end
  end
  if not chosen and best and best_load <= min_load + slack then
    chosen, reason = best, 'group'
  end
  if not chosen then
    chosen = min_backend
  end
  redis.call('SADD', group_key, chosen)
  redis.call('EXPIRE', group_key, affinity_ttl_s)
elseif not chosen then
  chosen = min_backend
end

redis.call('ZINCRBY', up, 1, chosen)
local lease = worker .. ':' .. redis.call('INCR', seq)
redis.call('ZADD', leases, now + ttl_ms, lease)
redis.call('HSET', lease_backend, lease, chosen)
redis.call('SET', job_key, chosen, 'EX', affinity_ttl_s)
return {lease, chosen, reason}
