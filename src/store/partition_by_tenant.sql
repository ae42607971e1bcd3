-- Turns idempotency_records into a table hash-partitioned by tenant, with `idemstore.partitions`
-- partitions (a transaction-local setting). Run after the migrations, in one transaction, with the
-- application stopped: the table is locked while its rows are copied, and a claim or completion that
-- waits longer than its lock timeout fails (the lock itself is given up after 5 s rather than queue
-- every request behind a long transaction). Rows keep their fences. A table already partitioned into
-- that many partitions is left as it is; into another number, refused.
--
-- The primary key (digest, tenant) already holds the partition column, so "one
-- key, one winner" stays one unique constraint per partition. Index and constraint names stay as the
-- migrations named them, so later migrations apply to both layouts.
DO $$
DECLARE
    partitions int := current_setting('idemstore.partitions')::int;
    existing int;
    index_definitions text[];
    primary_key text;
    definition text;
    old_index regclass;
    privilege record;
    schema_name text;
    owner_name text;
    options text[];
BEGIN
    -- Twice: before the lock, so that running it again on a live store takes no lock at all; and
    -- under the lock, for a conversion that committed meanwhile.
    FOR attempt IN 1 .. 2 LOOP
        IF EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'idempotency_records'::regclass) THEN
            SELECT count(*) INTO existing FROM pg_inherits WHERE inhparent = 'idempotency_records'::regclass;
            IF existing <> partitions THEN
                RAISE EXCEPTION 'idempotency_records is already partitioned into % partitions, not %',
                    existing, partitions;
            END IF;
            RETURN;
        END IF;
        IF attempt = 1 THEN
            PERFORM set_config('lock_timeout', '5s', true);
            LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE;
            PERFORM set_config('lock_timeout', '0', true);
        END IF;
    END LOOP;

    -- What a copy would silently lose is refused instead: convert such a table by hand.
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'idempotency_records'::regclass AND NOT tgisinternal)
       OR EXISTS (SELECT 1 FROM pg_policy WHERE polrelid = 'idempotency_records'::regclass)
       OR EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = 'idempotency_records'::regclass)
       OR EXISTS (SELECT 1 FROM pg_class WHERE oid = 'idempotency_records'::regclass
                                           AND (relrowsecurity OR relforcerowsecurity))
       OR EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'idempotency_records'::regclass AND attacl IS NOT NULL)
       OR EXISTS (SELECT 1 FROM pg_rewrite WHERE ev_class = 'idempotency_records'::regclass) THEN
        RAISE EXCEPTION 'idempotency_records has triggers, row security, column privileges, rules or '
            'publications of its own: partition it by hand (see docs/scale-out.md)';
    END IF;
    SELECT n.nspname, pg_get_userbyid(c.relowner), c.reloptions INTO schema_name, owner_name, options
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'idempotency_records'::regclass;

    SELECT array_agg(pg_get_indexdef(indexrelid)) INTO index_definitions
    FROM pg_index WHERE indrelid = 'idempotency_records'::regclass AND NOT indisprimary;
    SELECT pg_get_constraintdef(oid) INTO primary_key
    FROM pg_constraint WHERE conrelid = 'idempotency_records'::regclass AND contype = 'p';

    -- The old table gives up its names before the new one takes them.
    ALTER TABLE idempotency_records RENAME TO idempotency_records_unpartitioned;
    ALTER TABLE idempotency_records_unpartitioned DROP CONSTRAINT idempotency_records_pkey;
    FOR old_index IN
        SELECT indexrelid::regclass FROM pg_index WHERE indrelid = 'idempotency_records_unpartitioned'::regclass
    LOOP
        EXECUTE format('DROP INDEX %s', old_index);
    END LOOP;

    -- In the old table's schema (the index definitions name it), owned by its owner, with its grants.
    EXECUTE format('CREATE TABLE %I.idempotency_records (LIKE %I.idempotency_records_unpartitioned
        INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS INCLUDING STATISTICS)
        PARTITION BY HASH (tenant)', schema_name, schema_name);
    EXECUTE format('ALTER TABLE %I.idempotency_records OWNER TO %I', schema_name, owner_name);
    FOR privilege IN
        SELECT a.privilege_type, a.grantee, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = format('%I.idempotency_records_unpartitioned', schema_name)::regclass
    LOOP
        EXECUTE format('GRANT %s ON %I.idempotency_records TO %s%s', privilege.privilege_type, schema_name,
            CASE WHEN privilege.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(privilege.grantee)) END,
            CASE WHEN privilege.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    EXECUTE format('ALTER TABLE %I.idempotency_records ADD CONSTRAINT idempotency_records_pkey %s',
        schema_name, primary_key);
    FOREACH definition IN ARRAY coalesce(index_definitions, '{}') LOOP
        EXECUTE definition;
    END LOOP;
    FOR i IN 0 .. partitions - 1 LOOP
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.idempotency_records
            FOR VALUES WITH (MODULUS %s, REMAINDER %s) %s', schema_name, 'idempotency_records_p' || i,
            schema_name, partitions, i,
            CASE WHEN options IS NULL THEN '' ELSE 'WITH (' || array_to_string(options, ', ') || ')' END);
        EXECUTE format('ALTER TABLE %I.%I OWNER TO %I', schema_name, 'idempotency_records_p' || i, owner_name);
    END LOOP;

    INSERT INTO idempotency_records SELECT * FROM idempotency_records_unpartitioned;
    DROP TABLE idempotency_records_unpartitioned;
    ANALYZE idempotency_records;
END
$$;
