-- Init's waiting room (pipeline/priorities.py prepends this file to submit.lua and
-- init_feed.lua). A job waits in the sorted set KEYS[2], ranked by the time it was queued plus
-- (100 - priority) * priority_aging_s, and moves onto the init stream KEYS[1] only when a reader
-- is about to read it, so that the stream (first in, first out) never holds more than a reader
-- takes at once and a later, more urgent job can still go first.
-- A member is the queue time in ms (13 digits), ':' and the job's payload.

-- The stream's entries no consumer of `group` has read yet, counted up to `limit` (acknowledged
-- entries are deleted, so XLEN counts those at work too).
local function undelivered(stream, group, limit)
  if redis.call('EXISTS', stream) == 0 then
    return 0
  end
  local from = '-'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #g, 2 do
      info[g[i]] = g[i + 1]
    end
    if info['name'] == group then
      from = '(' .. info['last-delivered-id']
    end
  end
  return #redis.call('XRANGE', stream, from, '+', 'COUNT', limit)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
