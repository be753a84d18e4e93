-- Give back the in-flight slots of finished requests.
-- KEYS: backends, backends:down, leases, leases:backend
-- ARGV: lease ids
-- Returns how many leases were still held (the others had expired and were reclaimed).
local released = 0
for _, lease in ipairs(ARGV) do
  released = released + give_back(KEYS[1], KEYS[2], KEYS[3], KEYS[4], lease)
end
return released
