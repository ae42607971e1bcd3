-- Turns idempotency_records into a table hash-partitioned by tenant, with `idemstore.partitions`
-- partitions (a transaction-local setting). Run after the migrations, in one transaction: the table
-- is locked while its rows are copied (claims and completions wait, then find the same rows under
-- the same fences: no lease is cut short). A table already partitioned into that many partitions is
-- left as it is; into another number, refused.
--
-- The primary key (tenant, operation, idempotency_key) already holds the partition column, so "one
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
BEGIN
    LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'idempotency_records'::regclass) THEN
        SELECT count(*) INTO existing FROM pg_inherits WHERE inhparent = 'idempotency_records'::regclass;
        IF existing <> partitions THEN
            RAISE EXCEPTION 'idempotency_records is already partitioned into % partitions, not %',
                existing, partitions;
        END IF;
        RETURN;
    END IF;

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

    CREATE TABLE idempotency_records (LIKE idempotency_records_unpartitioned
        INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS INCLUDING STATISTICS)
        PARTITION BY HASH (tenant);
    EXECUTE format('ALTER TABLE idempotency_records ADD CONSTRAINT idempotency_records_pkey %s', primary_key);
    FOREACH definition IN ARRAY coalesce(index_definitions, '{}') LOOP
        EXECUTE definition;
    END LOOP;
    FOR i IN 0 .. partitions - 1 LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF idempotency_records FOR VALUES WITH (MODULUS %s, REMAINDER %s)',
            'idempotency_records_p' || i, partitions, i);
    END LOOP;

    INSERT INTO idempotency_records SELECT * FROM idempotency_records_unpartitioned;
    DROP TABLE idempotency_records_unpartitioned;
    ANALYZE idempotency_records;
END
$$;
