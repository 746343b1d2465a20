
-- Why the assignment runs on its backend: the trust decision over the forge context, as the
-- scheduler recorded it on the assignment message (kept from attempt 1 across redispatches).
ALTER TABLE assignments ADD COLUMN placement text;
