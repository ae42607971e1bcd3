//! The source of truth: every statement of the protocol, one round trip each, fenced where it writes.

use std::future::Future;
use std::time::Duration;

use sqlx::Row as _;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use tokio::sync::oneshot;
use tracing::Instrument as _;

use super::Background;
use super::awaiting::Awaiting;
use super::group_commit::{Alone, Batched, Completion, GroupCommit, NewClaim};
use super::statement::{self, ACQUIRE, Statement};
use crate::error::StoreError;
use crate::key::{IdempotencyKey, KeyDigest, Scope, key_digest};
use crate::policy::{LeaseExpiry, millis};
use crate::quota::QuotaLimit;
use crate::record::{Lease, Record, State, StoredResponse};

/// Milliseconds from now until `$moment`, rounded up, never negative: from the transaction's start
/// (`now()`), or from the moment given (`clock_timestamp()` for a completion, see [`completed`]).
macro_rules! millis_until {
    ($moment:expr) => {
        millis_until!($moment, from: "now()")
    };
    ($moment:expr, from: $now:expr) => {
        concat!("CEIL(GREATEST(0, EXTRACT(EPOCH FROM ", $moment, " - ", $now, ") * 1000))::bigint")
    };
}

/// The record columns every read returns, with the lease and retention as milliseconds of server time,
/// so that application clocks never take part in a lease decision.
macro_rules! record_columns {
    () => {
        concat!(
            "state, fingerprint, fence, response, tier, on_lease_expiry,
             CASE WHEN lease_expires_at IS NOT NULL THEN ",
            millis_until!("lease_expires_at"),
            " END AS lease_ms,
             CASE WHEN expires_at IS NOT NULL THEN ",
            millis_until!("expires_at"),
            " END AS expires_ms"
        )
    };
}

/// A key's live tombstone, found by the key's digest (`$digest`, the application's
/// [`key_digest`](crate::key::key_digest): the same value as `idempotency_key_digest($1, $2, $3)`, which
/// Postgres cannot inline and parses again on every call), shaped like a record in state `expired`: its
/// fingerprint is the first 8 bytes of the one that completed, its expiry the end of the tombstone's
/// horizon.
macro_rules! tombstone {
    ($digest:expr) => {
        concat!(
            "SELECT 'e'::\"char\" AS state, int8send(fingerprint) AS fingerprint, fence,
                NULL::text AS owner, NULL::bytea AS response, NULL::text AS tier, NULL::\"char\" AS on_lease_expiry,
                NULL::timestamptz AS lease_expires_at, expires_at
         FROM idempotency_tombstones
         WHERE digest = ",
            $digest,
            "::uuid AND (expires_at IS NULL OR expires_at > now())"
        )
    };
}

/// When an in-progress record under `$retention` milliseconds (NULL: forever) expires: never before its
/// lease (`$lease` milliseconds) ends, so retention cannot cut a live lease.
macro_rules! in_progress_expiry {
    (lease: $lease:expr, retention: $retention:expr) => {
        concat!(
            "CASE WHEN ",
            $retention,
            " IS NOT NULL
                  THEN now() + GREATEST(",
            $lease,
            ", ",
            $retention,
            ") * interval '1 millisecond' END"
        )
    };
}

/// The tenant's quota (`$12` new keys per window of `$13` milliseconds, `$14` live keys; NULL for no
/// limit), as CTEs of the claim: `over_new_keys` and `over_live_keys` hold a row (the limit, and when a
/// place should free if nothing else starts: the estimate falls below the limit, the soonest live lease
/// ends) when the limit is reached. `now_in_windows` is the time in windows since the epoch.
///
/// New keys are counted in `idempotency_quota_usage`, per window of the epoch and per Postgres backend
/// (no claim waits for another connection's counter, even inside a long transaction), and estimated over
/// a sliding window: the previous window's count, weighted by how much of it the sliding window still
/// covers, plus the current one's. Reading it costs a row per connection that counted in those two
/// windows, whatever the limit. Live keys are counted from the in-progress records (a partial index),
/// at most `$14` entries. Claims open in other transactions are in no snapshot: they hold slots of their
/// own ([`HOLD_KEY`]), and a claim made in a transaction that found no free slot binds `$14` = 0:
/// new keys and re-acquisitions are held back, and keys with a record are answered from it as ever.
macro_rules! quota_ctes {
    () => {
        "new_keys_used AS (
        SELECT now_in_windows,
               coalesce(sum(claims) FILTER (WHERE window_index = floor(now_in_windows)), 0)::float8 AS current,
               coalesce(sum(claims) FILTER (WHERE window_index = floor(now_in_windows) - 1), 0)::float8 AS previous
        FROM (SELECT extract(epoch FROM now()) * 1000 / $13::float8 AS now_in_windows) AS clock
        LEFT JOIN idempotency_quota_usage
               ON tenant = $1 AND operation = $2 AND window_ms = $13::float8::bigint
              AND window_index IN (floor(now_in_windows)::bigint - 1, floor(now_in_windows)::bigint)
        WHERE $12::int4 IS NOT NULL
        GROUP BY now_in_windows
    ), over_new_keys AS (
        SELECT 'n'::\"char\" AS quota_limit,
               to_timestamp($13::float8 / 1000 * CASE
                   WHEN current + 1 <= $12::int4 THEN floor(now_in_windows) + 1 - ($12::int4 - 1 - current) / previous
                   ELSE floor(now_in_windows) + 2 - ($12::int4 - 1) / current END) AS frees_at
        FROM new_keys_used
        WHERE previous * (1 - (now_in_windows - floor(now_in_windows))) + current + 1 > $12::int4
    ), over_live_keys AS (
        SELECT 'l'::\"char\" AS quota_limit,
               coalesce(min(lease_expires_at), now() + $6::float8 * interval '1 millisecond') AS frees_at
        FROM (
            SELECT lease_expires_at FROM idempotency_records
            WHERE $14::int4 IS NOT NULL AND tenant = $1 AND operation = $2
              AND state = 'p' AND lease_expires_at > now()
            ORDER BY lease_expires_at LIMIT $14::int4) AS live
        HAVING count(*) >= $14::int4
    ), "
    };
}

/// A new in-progress record from a claim's values (the claim's parameters `$1`..`$10`, or the columns of
/// `v`, one row per claim of a batch): the caller's policy (its tier, rule, retention and horizon stay
/// with the record) and the next fence. The statement goes on after the select list (`FROM`, `WHERE`).
macro_rules! insert_new_record {
    () => {
        insert_new_record!("$11", "$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8", "$9", "$10")
    };
    (v) => {
        insert_new_record!(
            "v.digest", "v.tenant", "v.operation", "v.idempotency_key", "v.fingerprint", "v.owner", "v.lease_ms", "v.retention_ms",
            "v.take_over", "v.tier", "v.tombstone_ms"
        )
    };
    ($digest:expr, $tenant:expr, $operation:expr, $key:expr, $fingerprint:expr, $owner:expr, $lease:expr, $retention:expr,
     $take_over:expr, $tier:expr, $tombstone:expr) => {
        concat!(
            "INSERT INTO idempotency_records AS r
                (digest, tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at,
                 expires_at, tier, on_lease_expiry, retention_ms, tombstone_ms)
            SELECT ", $digest, "::uuid, ", $tenant, ", ", $operation, ", ", $key, ", ", $fingerprint, ", 'p'::\"char\",
                   nextval('idempotency_fences'), ", $owner, ",
                   now() + ", $lease, "::float8 * interval '1 millisecond',
                   ",
            in_progress_expiry!(lease: concat!($lease, "::float8"), retention: concat!($retention, "::float8")),
            ",
                   ", $tier, ", CASE WHEN ", $take_over, " THEN 't' ELSE 'm' END::\"char\", ", $retention,
            "::float8::bigint, ", $tombstone, "::float8::bigint"
        )
    };
}

/// A row shaped like a record with nothing in it, for an answer that has no record.
macro_rules! no_record {
    () => {
        "(SELECT NULL::\"char\" AS state, NULL::bytea AS fingerprint, NULL::bigint AS fence,
                  NULL::bytea AS response, NULL::text AS tier, NULL::\"char\" AS on_lease_expiry,
                  NULL::timestamptz AS lease_expires_at, NULL::timestamptz AS expires_at) AS nothing"
    };
}

/// The key's lock (`$lock`, see [`key_lock`]), shared, as the claim's first CTE: `key_lock.held`. Every
/// claim tries it, and holds it until its transaction ends (outside the caller's transaction, the
/// statement's own). A claim inside a transaction that reads ([`CLAIM_IN_TX`]) holds it exclusively
/// until it commits, and writes no row meanwhile: no other claim may write the key then. Claims that
/// write share it, and the primary key decides between them, as ever. The claim writes only if it holds
/// it; otherwise it answers `held` false with the record as committed, if any.
macro_rules! key_lock_cte {
    ($lock:expr) => {
        concat!("key_lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock_shared(", $lock, "::int8) AS held)")
    };
}

/// What a claim does to a record its insert meets: re-acquires it, under the record's own policy
/// (`r`), when it was released or its owner's lease ran out under its `take_over` rule; another payload
/// re-acquires only once the record expired. A re-acquisition takes a new fence: the next of the
/// sequence, and above the record's own even when the sequence fell behind the rows (a restore or a
/// logical replication that did not carry the sequence along).
macro_rules! reacquire {
    () => {
        concat!(
            "DO UPDATE
            SET fingerprint = EXCLUDED.fingerprint, state = 'p',
                fence = GREATEST(nextval('idempotency_fences'), r.fence + 1),
                owner = EXCLUDED.owner, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
                expires_at = ",
            in_progress_expiry!(lease: "$6::float8", retention: "r.retention_ms::float8"),
            ",
                waited = false, updated_at = now()
            WHERE (r.state = 'r' AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= now()))
               OR (r.state = 'p' AND r.lease_expires_at <= now() AND r.on_lease_expiry = 't'
                   AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= now()))"
        )
    };
}

/// The claim statement's text, with or without the quota's parts: a policy without a quota sends the
/// statement without them, which neither reads nor locks anything of the quota's.
macro_rules! claim_sql {
    (lock: $lock:expr, on_conflict: $on_conflict:expr, quota_ctes: $quota_ctes:expr, held_back: $held_back:expr,
     counted: $counted:expr, prior_quota: $prior_quota:expr, refused: $refused:expr $(,)?) => {
        concat!(
            "WITH ",
            key_lock_cte!($lock),
            ", prior AS (
            SELECT state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
            FROM idempotency_records
            WHERE digest = $11::uuid AND tenant = $1
        ), buried AS (",
            tombstone!("$11"),
            " AND NOT EXISTS (SELECT 1 FROM prior)
        ), ",
            $quota_ctes,
            "claimed AS (
            ",
            insert_new_record!(),
            "
            WHERE (SELECT held FROM key_lock)
              AND NOT EXISTS (SELECT 1 FROM buried)
              AND NOT EXISTS (SELECT 1 FROM prior WHERE state IN ('c', 'i')
                                                     OR (state = 'p' AND (lease_expires_at > now()
                                                         OR on_lease_expiry = 'm')))",
            $held_back,
            "
            ON CONFLICT (digest, tenant) ",
            $on_conflict,
            "
            RETURNING state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
    ",
            $counted,
            "
        )
        SELECT true AS acquired, (SELECT state FROM prior) AS prior_state, NULL::\"char\" AS quota_limit,
               NULL::bigint AS quota_retry_ms, ",
            record_columns!(),
            ", true AS held FROM claimed
        UNION ALL
        SELECT coalesce(state = 'p' AND owner = $5 AND lease_expires_at > now(), false), NULL, ",
            $prior_quota,
            record_columns!(),
            ", (SELECT held FROM key_lock) FROM prior WHERE NOT EXISTS (SELECT 1 FROM claimed)
        UNION ALL
        SELECT false, NULL, NULL, NULL, ",
            record_columns!(),
            ", (SELECT held FROM key_lock) FROM buried
        UNION ALL
        SELECT false, NULL, NULL, NULL, ",
            record_columns!(),
            ", false FROM ",
            no_record!(),
            "
        WHERE NOT (SELECT held FROM key_lock) AND NOT EXISTS (SELECT 1 FROM prior)
          AND NOT EXISTS (SELECT 1 FROM buried)",
            $refused
        )
    };
}

/// The claim, in one round trip. Inserts a fresh record under the caller's policy (its tier, rule,
/// retention and horizon stay with the record), or re-acquires one ([`reacquire`]).
/// Completed and indeterminate records, live leases and tombstones are never written: the statement
/// returns them (`prior`, `buried`, read from its snapshot) for the caller to answer from, without a
/// row lock. A live record of this very claim (its owner, a token no other call has) is acquired: a
/// batch wrote it, and the caller never heard (see [`group_commit`](super::group_commit)). `prior` also
/// says what was re-acquired (for the takeover metric). `quota_limit` and `quota_retry_ms` are NULL
/// ([`CLAIM_UNDER_QUOTA`] fills them). It takes the key's lock (`$12`, see [`key_lock_cte`]): without it,
/// nothing is written and the one row is `held` false, with the record as committed (`prior`, `buried`)
/// or none.
const CLAIM: Statement = Statement::new(
    "claim",
    claim_sql!(
        lock: "$12",
        on_conflict: reacquire!(),
        quota_ctes: "",
        held_back: "",
        counted: "",
        prior_quota: "NULL, NULL, ",
        refused: ""
    ),
);

/// [`CLAIM`] under the tenant's quota (`$12`..`$14`, see [`quota_ctes`]; the key's lock is `$15`): it
/// holds back a new record
/// while either limit is reached, and a re-acquisition while the live-key limit is; a new record is
/// counted (`counted`). The quota is read only where the claim would write: a key answered from its
/// record costs nothing more. A refusal comes back as `quota_limit` and `quota_retry_ms`, with `prior`'s
/// record, or with NULL record columns for a new key.
const CLAIM_UNDER_QUOTA: Statement = Statement::new(
    "claim",
    claim_sql!(
        lock: "$15",
        on_conflict: reacquire!(),
        quota_ctes: quota_ctes!(),
        held_back: "
          AND NOT EXISTS (SELECT 1 FROM over_live_keys)
          AND (EXISTS (SELECT 1 FROM prior) OR NOT EXISTS (SELECT 1 FROM over_new_keys))",
        counted: "    ), counted AS (
        INSERT INTO idempotency_quota_usage AS u
            (tenant, operation, window_ms, window_index, backend, claims, expires_at)
        SELECT $1, $2, $13::float8::bigint, floor(now_in_windows)::bigint, pg_backend_pid(), 1,
               to_timestamp($13::float8 / 1000 * (floor(now_in_windows) + 2))
        FROM new_keys_used WHERE EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM prior)
        ON CONFLICT (tenant, operation, window_ms, window_index, backend) DO UPDATE SET claims = u.claims + 1",
        prior_quota: concat!(
            "CASE WHEN state = 'r' OR (state = 'p' AND lease_expires_at <= now())
                  THEN (SELECT quota_limit FROM over_live_keys) END,
             CASE WHEN state = 'r' OR (state = 'p' AND lease_expires_at <= now())
                  THEN (SELECT ",
            millis_until!("frees_at"),
            " FROM over_live_keys) END, "
        ),
        refused: concat!(
            "
    UNION ALL
    SELECT false, NULL, reached.quota_limit, ",
            millis_until!("reached.frees_at"),
            ", ",
            record_columns!(),
            ", true FROM ",
            no_record!(),
            ",
           (SELECT * FROM over_new_keys UNION ALL SELECT * FROM over_live_keys ORDER BY frees_at DESC LIMIT 1)
               AS reached
    WHERE (SELECT held FROM key_lock) AND NOT EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM prior)
      AND NOT EXISTS (SELECT 1 FROM buried)"
        ),
    ),
);

/// The key, and a place among its tenant's live keys, for a claim under a live-key quota made inside the
/// caller's transaction, before the claim is sent: `held`, the key's own transaction-level advisory lock
/// (`$1`, see [`key_lock`]); then, only when it is held, `slot`, one advisory lock among the tenant's
/// slots (`$3`, the limit, at most 65,536 slots; key: `$2`, the namespace of the tenant and operation,
/// shifted left 16 bits, and the slot), or NULL when all are held. Both are held until that transaction
/// ends.
///
/// The key's lock is what a duplicate meets while the owner's transaction is open: its claim is in no
/// snapshot, and the claim's insert would wait on its row for the whole lock timeout, holding a pool
/// connection, a Postgres backend and (under a quota) a slot that the tenant's new keys need. Not held:
/// another transaction claims the key now, or answers from its record; the caller writes nothing and
/// answers from the record as committed ([`ClaimAnswer::Held`]). Without a quota the transaction begins
/// with the lock ([`begin_statement`]), and no round trip is added for it.
///
/// The slots are what the live-key quota counts of such claims: unlike rows, other backends see them at
/// once. (Claims outside transactions do not read them: that is a scan of `pg_locks`, which takes every
/// lock partition, on every claim under the limit.) The slots are a set-returning function in the select
/// list, so they are tried one at a time and the first lock taken ends the subquery.
const HOLD_KEY: Statement = Statement::new(
    "hold_key",
    "SELECT held, CASE WHEN held THEN (
         SELECT slot FROM (SELECT generate_series(0, least($3::int4, 65536) - 1) AS slot) AS slots
         WHERE pg_try_advisory_xact_lock(($2::int8 << 16) | slot) LIMIT 1) END AS slot
     FROM (SELECT pg_try_advisory_xact_lock($1::int8) AS held) AS key",
);

/// The advisory lock of one key ([`key_lock_cte`]): 63 bits of its digest, negative, so that no key's lock is
/// ever a live-key slot (those are positive, see [`live_slots`]).
pub(crate) fn key_lock(digest: &KeyDigest) -> i64 {
    let high = u64::from_str_radix(&digest.as_str()[..16], 16).unwrap_or_default();
    (high | 1 << 63) as i64
}

/// The advisory-lock namespace of a tenant's live-key slots under one operation ([`HOLD_KEY`]):
/// 47 bits of a digest, so that no tenant can pick a name whose slots are another's (a second preimage
/// of 47 bits) and every lock key is positive. An application's own single-key advisory locks that fall
/// in the same range count towards the limit: they can only refuse early.
fn live_slots(scope: &Scope) -> i64 {
    let digest = crate::key::digest_of(b"idemstore-live-keys\0", [scope.tenant(), scope.operation()]);
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&digest[..8]);
    (u64::from_le_bytes(bytes) >> 17) as i64
}

/// The claim of a key that is most likely new (Redis had nothing of it, or there is no Redis), without
/// a quota: [`CLAIM`] without its re-acquisition. Same parameters and row. A new key is the common case,
/// and this statement writes nothing to a key that has a record: it answers from it, so a replay (and a
/// duplicate, and another payload) costs one statement on the Postgres path. Only a record this claim
/// would re-acquire (released, or a lease that ran out), or one committed after the statement's
/// snapshot (no row at all), is left to [`CLAIM`].
const CLAIM_NEW: Statement = Statement::new(
    "claim",
    claim_sql!(
        lock: "$12",
        on_conflict: "DO NOTHING",
        quota_ctes: "",
        held_back: "",
        counted: "",
        prior_quota: "NULL, NULL, ",
        refused: ""
    ),
);

/// [`CLAIM_NEW`] for a batch of keys ([`group_commit`](super::group_commit)): one row of `v` per claim,
/// from arrays of the same parameters (`$1`..`$11`), in the order of the keys (every batch writes its
/// keys in that order, so two batches never wait for each other in a circle). A key already in the
/// table or buried is left out, as is a second claim of one key in the batch; the new records come back
/// with their `owner`, which tells whose each is. The lookups are scalar subqueries, which Postgres
/// runs as an index lookup per row: as a join, a plan made on stale statistics (a new table) can scan
/// every record for each batch.
/// Each key's lock ([`key_lock`], `$12`) is tried, shared, as every claim tries it ([`key_lock_cte`]),
/// and held until the batch commits: a key whose lock a claim inside a transaction holds
/// ([`CLAIM_IN_TX`]) is left out too. A key whose record another transaction is writing (a batch under way, a claim under a
/// quota inside a transaction) makes the insert wait for that transaction: the statement waits at most 50 ms
/// (`set_config(.., true)` holds for this statement's own transaction only), then fails, and each of
/// its callers claims alone, waiting for its own key only, up to the store's lock timeout.
pub(crate) const CLAIM_NEW_BATCH: Statement = Statement::new(
    "claim",
    concat!(
        "WITH bounded AS MATERIALIZED (SELECT set_config('lock_timeout', '50ms', true))
    ",
        insert_new_record!(v),
        "
    FROM bounded, unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::float8[], $7::float8[],
                $8::bool[], $9::text[], $10::float8[], $11::text[], $12::int8[])
         AS v(tenant, operation, idempotency_key, fingerprint, owner, lease_ms, retention_ms, take_over, tier,
              tombstone_ms, digest, key_lock)
    WHERE (SELECT true FROM idempotency_records x
           WHERE x.digest = v.digest::uuid AND x.tenant = v.tenant LIMIT 1) IS NULL
      AND (SELECT true FROM (",
        tombstone!("v.digest"),
        ") AS buried LIMIT 1) IS NULL
      AND pg_try_advisory_xact_lock_shared(v.key_lock)
    ON CONFLICT (digest, tenant) DO NOTHING
    RETURNING owner, ",
        record_columns!()
    ),
);

/// A key's record, or its live tombstone once the record was purged.
/// A key's record, or its tombstone (`$1` digest, `$2` tenant): no row when neither is there.
macro_rules! lookup {
    () => {
        concat!(
            "WITH found AS (
        SELECT state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
        FROM idempotency_records WHERE digest = $1::uuid AND tenant = $2
    )
    SELECT ",
            record_columns!(),
            " FROM found
    UNION ALL
    SELECT ",
            record_columns!(),
            " FROM (",
            tombstone!("$1"),
            ") AS buried WHERE NOT EXISTS (SELECT 1 FROM found)"
        )
    };
}

const LOOKUP: Statement = Statement::new("lookup", lookup!());

/// What a retry attaching to its request reads ([`PostgresTier::attach`]): one row, `held` (whether a
/// transaction holds the key's lock `$3` now: a transactional owner, whose record is written only with
/// its commit) and the record's columns, NULL when the key has neither record nor tombstone. The lock is
/// only tried, shared, for this statement: plain claims take it shared too, so only an open
/// transactional claim makes `held` true, and nothing waits.
const ATTACH: Statement = Statement::new(
    "attach",
    concat!(
        "SELECT NOT pg_try_advisory_xact_lock_shared($3::int8) AS held, looked.*
         FROM (SELECT 1) AS one LEFT JOIN (",
        lookup!(),
        ") AS looked ON true"
    ),
);

/// The claim of a key inside the caller's transaction without a quota: a read, which writes no row
/// version. The transaction began holding the key's lock, or knowing another holds it ([`begin_statement`],
/// `$3`, see [`key_lock`]); this statement's snapshot, taken after that, sees every claim committed by
/// an earlier holder (its lock is released after its commit is visible). Every claim takes that lock,
/// so while this transaction holds it no other claim of the key writes or acquires: a key without a
/// record is acquired with the next fence, and its record is written once, completed, by
/// [`COMPLETE_IN_TX`] before the commit. The row: `held` (NULL when the transaction did not begin with
/// this key's lock, or runs above read committed, where the snapshot predates the lock: the claim is
/// then made by insert, [`claim_on`]), and the record as committed, if any (the fence of the new
/// record, if not).
const CLAIM_IN_TX: Statement = Statement::new(
    "claim",
    concat!(
        "WITH key_lock AS MATERIALIZED (
        SELECT CASE WHEN current_setting('transaction_isolation') <> 'read committed' THEN NULL
                    WHEN current_setting('idemstore.key_lock', true) = 'true:' || $3::int8 THEN true
                    WHEN current_setting('idemstore.key_lock', true) = 'false:' || $3::int8 THEN false
               END AS held
    ), found AS (
        SELECT state, fingerprint, fence, owner, response, tier, on_lease_expiry, lease_expires_at, expires_at
        FROM idempotency_records WHERE digest = $1::uuid AND tenant = $2
    ), buried AS (",
        tombstone!("$1"),
        " AND NOT EXISTS (SELECT 1 FROM found)
    )
    SELECT held, ",
        record_columns!(),
        " FROM key_lock, (SELECT * FROM found UNION ALL SELECT * FROM buried) AS record
    UNION ALL
    SELECT held, NULL, NULL, CASE WHEN held THEN nextval('idempotency_fences') END, NULL, NULL, NULL, NULL, NULL
    FROM key_lock WHERE NOT EXISTS (SELECT 1 FROM found) AND NOT EXISTS (SELECT 1 FROM buried)"
    ),
);

/// The completion's writes to the record `r`, with the stored response `$response`: retention counts
/// from completion, under the retention the record was claimed under. From the completion's own moment
/// (`clock_timestamp()`), not its transaction's start (`now()`): a completion inside the claim's
/// transaction (the transactional HTTP path, `run_once_in_tx`) comes as long after its start as the
/// work took, and retention measured from the start would end that much early.
macro_rules! completed {
    ($response:expr) => {
        concat!(
            "SET state = 'c', response = ",
            $response,
            ", owner = NULL, lease_expires_at = NULL,
        expires_at = clock_timestamp() + r.retention_ms::float8 * interval '1 millisecond',
        updated_at = now()"
        )
    };
}

/// How long a completed record is kept, and whether a claim waits for it: from the completion's moment
/// too, so that Redis's copy (whose TTL this bounds) ends no later than the record.
macro_rules! retained_columns {
    () => {
        concat!(
            "waited, CASE WHEN expires_at IS NOT NULL THEN ",
            millis_until!("expires_at", from: "clock_timestamp()"),
            " END AS expires_ms"
        )
    };
}

const COMPLETE: Statement = Statement::new(
    "complete",
    concat!(
        "
    UPDATE idempotency_records AS r ",
        completed!("$4"),
        "
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3
      AND state IN ('p', 'i')
    RETURNING ",
        retained_columns!()
    ),
);

/// The completion inside the claim's transaction: the record inserted once, completed (a claim by
/// [`CLAIM_IN_TX`] wrote none), or the fenced [`COMPLETE`] of the record the claim wrote (by insert, or
/// re-acquired). `$1`..`$4` as [`COMPLETE`]; then the claim's `$5` operation, `$6` key, `$7`
/// fingerprint and the policy it was made under: `$8` tier, `$9` take over, `$10` retention and `$11`
/// tombstone milliseconds; `$12` the key's lock. Only a claim of this very transaction is completed: a
/// record read under the lock it still holds (the setting [`begin_statement`] wrote ends with the
/// transaction), or the row it wrote. A transaction the caller's work ended on its own (a `ROLLBACK` or
/// `COMMIT` of its own, after which these statements run outside it) completes nothing: the lease is
/// lost, never a record stored for writes that were rolled back.
const COMPLETE_IN_TX: Statement = Statement::new(
    "complete",
    concat!(
        "
    INSERT INTO idempotency_records AS r
        (digest, tenant, operation, idempotency_key, fingerprint, state, fence, response, expires_at, tier,
         on_lease_expiry, retention_ms, tombstone_ms)
    SELECT $1::uuid, $2, $5, $6, $7, 'c', $3, $4, clock_timestamp() + $10::float8 * interval '1 millisecond', $8,
           CASE WHEN $9 THEN 't' ELSE 'm' END::\"char\", $10::float8::bigint, $11::float8::bigint
    WHERE current_setting('idemstore.key_lock', true) = 'true:' || $12::int8
       OR EXISTS (SELECT 1 FROM idempotency_records WHERE digest = $1::uuid AND tenant = $2 AND fence = $3)
    ON CONFLICT (digest, tenant) DO UPDATE ",
        completed!("EXCLUDED.response"),
        "
    WHERE r.fence = EXCLUDED.fence AND r.state IN ('p', 'i')
    RETURNING ",
        retained_columns!()
    ),
);

/// [`COMPLETE`] for a batch of leases ([`group_commit`](super::group_commit)), from arrays of its
/// parameters (`$1`..`$5`): each completed record comes back with its place in the arrays (`n`, from 1).
/// A record another transaction holds is skipped, not waited for (one locked key must not hold back
/// the batch), as is one whose fence moved on: those callers send [`COMPLETE`] themselves, which waits
/// or says the lease was lost. The rows are updated by their location as locked (`tableoid` tells the
/// partitions apart), and by key, which lets a plan made on stale statistics look each one up by index.
pub(crate) const COMPLETE_BATCH: Statement = Statement::new(
    "complete",
    concat!(
        "
    WITH locked AS (
        SELECT held.table_id, held.row_id, v.digest, v.tenant, v.response, v.n
        FROM unnest($1::text[], $2::text[], $3::int8[], $4::bytea[]) WITH ORDINALITY
             AS v(digest, tenant, fence, response, n),
        LATERAL (SELECT tableoid AS table_id, ctid AS row_id FROM idempotency_records r
                 WHERE r.digest = v.digest::uuid AND r.tenant = v.tenant AND r.fence = v.fence AND r.state IN ('p', 'i')
                 FOR UPDATE SKIP LOCKED) AS held
    )
    UPDATE idempotency_records AS r ",
        completed!("locked.response"),
        "
    FROM locked
    WHERE r.tableoid = locked.table_id AND r.ctid = locked.row_id
      AND r.digest = locked.digest::uuid AND r.tenant = locked.tenant
    RETURNING locked.n, ",
        retained_columns!()
    ),
);

const RELEASE: Statement = Statement::new(
    "release",
    "
    UPDATE idempotency_records
    SET state = 'r', owner = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3
      AND state IN ('p', 'i')
    RETURNING waited",
);

/// A new record claimed for a caller who never heard of it (in a batch, see [`group_commit`](
/// super::group_commit), or alone, see [`give_back`]), taken back whole: as if its statement had been
/// cancelled, which is what the caller was told (a release would leave a record that refuses another
/// payload). Counted as a release.
const FORGET: Statement = Statement::new(
    "release",
    "
    DELETE FROM idempotency_records
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3 AND state = 'p'
    RETURNING waited",
);

/// A completed record whose retention ended, under a policy that keeps no tombstone (`tombstone_ms` 0:
/// the record's own, so another caller's policy never frees a key), turned released, so that the next
/// claim re-acquires it with a new fence. Only while no transaction holds the key's lock (`$3`, see
/// [`key_lock`]; tried shared, as every claim tries it): one that does is claiming the key now, and
/// the row would be waited for as long as its work runs. The row: `held`, whether the lock was free.
const RENEW_EXPIRED: Statement = Statement::new(
    "renew_expired",
    "
    WITH key_lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock_shared($3::int8) AS held), renewed AS (
        UPDATE idempotency_records
        SET state = 'r', response = NULL, updated_at = now()
        WHERE digest = $1::uuid AND tenant = $2 AND state = 'c' AND tombstone_ms = 0 AND expires_at <= now()
          AND (SELECT held FROM key_lock)
        RETURNING 1
    )
    SELECT held FROM key_lock",
);

/// A claim that waits for the record's live owner asks to hear of its settlement: true if the record is
/// flagged (already, or now). A flagged record is not written again. Unfenced: a waiter told "in flight"
/// by Redis has no fence, and the flag only costs an owner a notification.
const WAIT: Statement = Statement::new(
    "wait",
    "
    WITH live AS (
        SELECT waited FROM idempotency_records
        WHERE digest = $1::uuid AND tenant = $2 AND state = 'p' AND lease_expires_at > now()
    ), flagged AS (
        UPDATE idempotency_records SET waited = true
        WHERE digest = $1::uuid AND tenant = $2 AND state = 'p' AND lease_expires_at > now() AND NOT waited
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM live WHERE waited) OR EXISTS (SELECT 1 FROM flagged)",
);

/// Tells waiting claims (of any store) that a waited-for record settled: sent after the settling commit,
/// in a transaction of its own.
const NOTIFY: Statement = Statement::new("notify", "SELECT pg_notify($1, $2)");

/// A lease extended past the record's expiry pushes the expiry along: retention never cuts a live lease.
const EXTEND: Statement = Statement::new(
    "extend",
    "
    UPDATE idempotency_records
    SET lease_expires_at = now() + $4::float8 * interval '1 millisecond',
        expires_at = CASE WHEN expires_at IS NOT NULL
                          THEN GREATEST(expires_at, now() + $4::float8 * interval '1 millisecond') END,
        updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3
      AND state = 'p'",
);

/// Only a lease that really ran out, and whose owner has not moved on since it was read, is marked.
const MARK_INDETERMINATE: Statement = Statement::new(
    "mark_indeterminate",
    "
    UPDATE idempotency_records
    SET state = 'i', updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3
      AND state = 'p' AND lease_expires_at <= now()",
);

/// How long a completed record is kept.
#[derive(Debug)]
pub(crate) struct Retained {
    /// Time until the record expires; `None` if it is kept forever.
    pub(crate) expires_in: Option<Duration>,
    /// A claim waits for this settlement and asked Postgres to announce it.
    pub(crate) waited: bool,
}

/// What the claim statement answered: the record it found or wrote, or the tenant's quota that held a
/// write back.
#[derive(Debug)]
pub(crate) enum ClaimAnswer {
    Claim(Claim),
    OverQuota {
        limit: QuotaLimit,
        retry_after: Duration,
    },
    /// Another claim holds the key's lock ([`key_lock_cte`]): it claims the key now (inside a transaction,
    /// until that commits), or answers from its record. Nothing was written; the record as committed, if
    /// any.
    Held(Option<Record>),
}

/// What the claim statement found or wrote.
#[derive(Debug)]
pub(crate) struct Claim {
    /// The caller now owns the key.
    pub(crate) acquired: bool,
    /// The record was re-acquired from an owner whose lease ran out.
    pub(crate) took_over: bool,
    /// The acquired record was there before this claim (released, or its owner's lease ran out).
    pub(crate) reacquired: bool,
    pub(crate) record: Record,
}

pub(crate) struct PostgresTier {
    pool: PgPool,
    /// Longest wait for one statement: a partitioned or stalled Postgres fails the call (closed)
    /// instead of holding the request forever.
    timeout: Duration,
    /// Claims of new keys and completions sent in batches; `None`: each alone.
    group: Option<GroupCommit>,
    /// Where lone claims run and claims nobody heard of are given back, so that a shutdown waits for them.
    background: Background,
}

impl PostgresTier {
    pub(crate) fn new(pool: PgPool, timeout: Duration, group: Option<GroupCommit>, background: Background) -> Self {
        Self { pool, timeout, group, background }
    }

    /// `call`, sent as `statement` under the store's timeout ([`statement::bounded`]).
    pub(crate) async fn bounded<T>(
        &self,
        statement: &Statement,
        call: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        statement::bounded(self.timeout, statement, call).await
    }

    /// How long a claim waits for a row lock on the store's own connections: a fair time for a caller
    /// told "in flight" after that wait to come back.
    pub(crate) fn lock_wait(&self) -> Duration {
        self.timeout / 2
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The claim on a pooled connection, or on `conn` (inside the caller's transaction) when given.
    /// `likely_new`: nothing says the key has a record, so [`CLAIM_NEW`] is tried first (without a
    /// quota), in a batch outside a transaction.
    pub(crate) async fn claim(
        &self,
        lease: &Lease,
        likely_new: bool,
        conn: Option<&mut PgConnection>,
    ) -> Result<ClaimAnswer, StoreError> {
        let digest = key_digest(&lease.scope, &lease.key);
        let mut new_key_first = likely_new && lease.policy.quota.is_off();
        let group = self.group.as_ref().filter(|_| new_key_first && conn.is_none());
        // Held until this call's own statement is done.
        let alone = group.and_then(|group| group.claims.alone());
        if alone.is_none()
            && let Some(group) = group
        {
            match group.claims.submit(NewClaim { lease: lease.clone(), digest }).await? {
                Batched::Answered(Some(record)) => {
                    return Ok(ClaimAnswer::Claim(Claim {
                        acquired: true,
                        took_over: false,
                        reacquired: false,
                        record,
                    }));
                }
                // Not new after all: the full claim answers.
                Batched::Answered(None) => new_key_first = false,
                Batched::AskAlone => {}
            }
        }
        let live_keys = lease.policy.quota.live_key_limit().map(as_int4);
        let Some(conn) = conn else {
            return self.claim_alone(lease, digest, new_key_first, live_keys, alone).await;
        };
        // The transaction began with the key's lock (without a quota), and the claim reads; under a quota
        // the lock comes first, with a slot, and the claim writes the record in progress.
        let lock = key_lock(&digest);
        if lease.policy.quota.is_off()
            && let Some(answer) = claim_by_lock(&mut *conn, self.timeout, lease, digest, lock).await?
        {
            return Ok(answer);
        }
        let live_keys = match live_keys {
            None => None,
            Some(limit) => {
                let hold = sqlx::query_as::<_, (bool, Option<i32>)>(HOLD_KEY.sql)
                    .bind(lock)
                    .bind(live_slots(&lease.scope))
                    .bind(limit);
                let (held, slot) = self.bounded(&HOLD_KEY, hold.fetch_one(&mut *conn)).await?;
                if !held {
                    let record = lookup_on(&mut *conn, self.timeout, &lease.scope, digest).await?;
                    return Ok(ClaimAnswer::Held(record));
                }
                // Every slot is another open transaction's claim: nothing may start, and a key with a
                // record is still answered from it.
                Some(if slot.is_some() { limit } else { 0 })
            }
        };
        claim_on(conn, self.timeout, lease, digest, new_key_first, live_keys, Some(lock)).await
    }

    /// The claim on a pooled connection, in a task of its own that finishes whatever becomes of its
    /// caller. A caller cancelled while its statement ran (a client gone) would otherwise leave a claim
    /// nobody heard of, in progress until its lease ran out (and then indeterminate, under
    /// [`LeaseExpiry::MarkIndeterminate`]); the task gives back a claim it acquired for nobody, as a
    /// batch does ([`group_commit`](super::group_commit)).
    async fn claim_alone(
        &self,
        lease: &Lease,
        digest: KeyDigest,
        new_key_first: bool,
        live_keys: Option<i32>,
        mut alone: Option<Alone>,
    ) -> Result<ClaimAnswer, StoreError> {
        let (pool, timeout, owned) = (self.pool.clone(), self.timeout, lease.clone());
        let (reply, answer) = oneshot::channel();
        let claiming = async move {
            let claimed = async {
                let mut pooled = statement::bounded(timeout, &ACQUIRE, pool.acquire()).await?;
                if let Some(alone) = alone.as_mut() {
                    alone.took_connection();
                }
                let lock = Some(key_lock(&digest));
                claim_on(&mut pooled, timeout, &owned, digest, new_key_first, live_keys, lock).await
            }
            .await;
            drop(alone);
            if let Err(Ok(ClaimAnswer::Claim(claim))) = reply.send(claimed)
                && claim.acquired
            {
                let lease = Lease { fence: claim.record.fence, ..owned };
                give_back(&pool, timeout, &lease, claim.reacquired, digest.as_str()).await;
            }
        };
        // A settlement: a shutdown waits for the claim and for its give-back.
        if self.background.settle(claiming.in_current_span()).is_none() {
            return Err(ACQUIRE.failed(sqlx::Error::WorkerCrashed));
        }
        let mut awaiting = Awaiting::new(answer, |claimed| self.give_back_unheard(lease, digest, claimed));
        // The task ended without an answer only if it panicked or its runtime is going away.
        (&mut awaiting.answer).await.unwrap_or_else(|_| Err(ACQUIRE.failed(sqlx::Error::WorkerCrashed)))
    }

    /// Gives back, in a settlement, a lone claim whose answer reached its caller's end ([`Awaiting`]) after
    /// the caller had left.
    fn give_back_unheard(&self, lease: &Lease, digest: KeyDigest, claimed: Result<ClaimAnswer, StoreError>) {
        let Ok(ClaimAnswer::Claim(claim)) = claimed else { return };
        if !claim.acquired {
            return;
        }
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        let lease = Lease { fence: claim.record.fence, ..lease.clone() };
        let giving_back = async move { give_back(&pool, timeout, &lease, claim.reacquired, digest.as_str()).await };
        if self.background.settle(giving_back).is_none() {
            tracing::warn!(
                fence = claim.record.fence,
                "a claim nobody heard of, without a runtime to give it back; its lease runs out instead"
            );
        }
    }

    pub(crate) async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        lookup_on(&self.pool, self.timeout, scope, key_digest(scope, key)).await
    }

    /// The key's record as committed, and whether an open transaction holds the key's lock ([`ATTACH`]).
    pub(crate) async fn attach(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<(bool, Option<Record>), StoreError> {
        let digest = key_digest(scope, key);
        let read = sqlx::query(ATTACH.sql).bind(digest.as_str()).bind(scope.tenant()).bind(key_lock(&digest));
        let row = self.bounded(&ATTACH, read.fetch_one(&self.pool)).await?;
        let decoded = (|| {
            let held: bool = row.try_get("held")?;
            let found = row.try_get::<Option<i8>, _>("state")?.is_some();
            Ok((held, found.then(|| decode_record(&row)).transpose()?))
        })();
        let (held, record) = decoded.map_err(|error| ATTACH.failed(error))?;
        // The statement's snapshot predates its try of the lock: a transactional owner that committed
        // and let go in between is seen by neither. Its record is visible once its lock is free, so a
        // key that looks free is read again.
        let looks_free = record.as_ref().is_none_or(|record| {
            record.state == State::Released
                || (record.state == State::InProgress && record.lease_remaining == Some(Duration::ZERO))
        });
        if held || !looks_free {
            return Ok((held, record));
        }
        Ok((false, lookup_on(&self.pool, self.timeout, scope, digest).await?))
    }

    /// The fenced completion, on `conn` (inside the caller's transaction, the one that claimed) when
    /// given. `None` when it matched no record (the lease was lost), else how long the record is kept.
    pub(crate) async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        conn: Option<&mut PgConnection>,
    ) -> Result<Option<Retained>, StoreError> {
        let group = self.group.as_ref().filter(|_| conn.is_none() && Completion::fits(response));
        let mut alone = group.and_then(|group| group.completions.alone());
        if alone.is_none()
            && let Some(group) = group
        {
            let completion = Completion { lease: lease.clone(), response: response.to_vec() };
            if let Batched::Answered(retained) = group.completions.submit(completion).await? {
                return Ok(Some(retained));
            }
        }
        let query = fenced(&COMPLETE, lease).bind(response);
        let row = match conn {
            Some(conn) => {
                let policy = &lease.policy;
                let query = fenced(&COMPLETE_IN_TX, lease)
                    .bind(response)
                    .bind(lease.scope.operation())
                    .bind(lease.key.as_str())
                    .bind(&lease.fingerprint.as_bytes()[..])
                    .bind(policy.name())
                    .bind(policy.lease_expiry == LeaseExpiry::TakeOver)
                    .bind(policy.retention.map(|r| millis(r) as f64))
                    .bind(policy.tombstone.map(|t| millis(t) as f64))
                    .bind(key_lock(&lease.digest()));
                self.bounded(&COMPLETE_IN_TX, query.fetch_optional(conn)).await?
            }
            None => {
                let mut pooled = self.bounded(&ACQUIRE, self.pool.acquire()).await?;
                if let Some(alone) = alone.as_mut() {
                    alone.took_connection();
                }
                self.bounded(&COMPLETE, query.fetch_optional(&mut *pooled)).await?
            }
        };
        row.as_ref().map(retained).transpose().map_err(|e| COMPLETE.failed(e))
    }

    /// Marks the record of `stale` (the lease that ran out, as read) indeterminate, on `conn` when given:
    /// the transaction whose claim holds the record's row lock must not wait for itself.
    pub(crate) async fn mark_indeterminate(
        &self,
        stale: &Lease,
        conn: Option<&mut PgConnection>,
    ) -> Result<bool, StoreError> {
        let query = fenced(&MARK_INDETERMINATE, stale);
        let done = match conn {
            Some(conn) => self.bounded(&MARK_INDETERMINATE, query.execute(conn)).await,
            None => self.bounded(&MARK_INDETERMINATE, query.execute(&self.pool)).await,
        };
        done.map(matched)
    }

    /// Frees the key of a completed record whose retention ended under a policy without a tombstone
    /// ([`RENEW_EXPIRED`]), on `conn` inside the caller's transaction when given; false when a
    /// transaction holds the key's lock (it claims the key now).
    pub(crate) async fn renew_expired(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        conn: Option<&mut PgConnection>,
    ) -> Result<bool, StoreError> {
        let digest = key_digest(scope, key);
        let renew =
            sqlx::query_scalar(RENEW_EXPIRED.sql).bind(digest.as_str()).bind(scope.tenant()).bind(key_lock(&digest));
        match conn {
            Some(conn) => self.bounded(&RENEW_EXPIRED, renew.fetch_one(conn)).await,
            None => self.bounded(&RENEW_EXPIRED, renew.fetch_one(&self.pool)).await,
        }
    }

    /// The fenced release: `None` when it matched no record (the lease was lost), else whether a claim
    /// waits for it.
    pub(crate) async fn release(&self, lease: &Lease) -> Result<Option<bool>, StoreError> {
        let waited = fenced(&RELEASE, lease).fetch_optional(&self.pool);
        let row = self.bounded(&RELEASE, waited).await?;
        row.map(|row| row.try_get("waited")).transpose().map_err(|e| RELEASE.failed(e))
    }

    /// Flags the key's in-progress record as waited for; false when it is not in progress (any more).
    pub(crate) async fn wait(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let flag = sqlx::query_scalar(WAIT.sql).bind(key_digest(scope, key).as_str().to_owned()).bind(scope.tenant());
        self.bounded(&WAIT, flag.fetch_one(&self.pool)).await
    }

    /// Announces the settlement of the key named `digest` to waiting claims.
    pub(crate) async fn notify(&self, digest: &str) -> Result<(), StoreError> {
        notify(&self.pool, self.timeout, digest).await
    }

    pub(crate) async fn extend(&self, lease: &Lease) -> Result<bool, StoreError> {
        let lease_ms = millis(lease.policy.lease) as f64;
        self.bounded(&EXTEND, fenced(&EXTEND, lease).bind(lease_ms).execute(&self.pool)).await.map(matched)
    }
}

/// The claim inside a transaction that began with the key's lock ([`CLAIM_IN_TX`]): `None` when the claim
/// must be made by insert instead ([`claim_on`]): the transaction did not begin with this key's lock or
/// runs above read committed, or the record is one to re-acquire.
async fn claim_by_lock(
    conn: &mut PgConnection,
    timeout: Duration,
    lease: &Lease,
    digest: KeyDigest,
    lock: i64,
) -> Result<Option<ClaimAnswer>, StoreError> {
    let query = sqlx::query(CLAIM_IN_TX.sql).bind(digest.as_str()).bind(lease.scope.tenant()).bind(lock);
    let row = statement::bounded(timeout, &CLAIM_IN_TX, query.fetch_one(conn)).await?;
    let read = || -> Result<Option<ClaimAnswer>, sqlx::Error> {
        let Some(held) = row.try_get::<Option<bool>, _>("held")? else { return Ok(None) };
        let record = match row.try_get::<Option<i8>, _>("state")? {
            Some(_) => Some(decode_record(&row)?),
            None => None,
        };
        Ok(match record {
            _ if !held => Some(ClaimAnswer::Held(record)),
            Some(record) if record.is_reacquired_by(&lease.fingerprint) => None,
            Some(record) => {
                Some(ClaimAnswer::Claim(Claim { acquired: false, took_over: false, reacquired: false, record }))
            }
            None => {
                let policy = &lease.policy;
                let record = Record {
                    state: State::InProgress,
                    fence: row.try_get("fence")?,
                    fingerprint: lease.fingerprint.as_bytes().to_vec(),
                    lease_remaining: Some(policy.lease),
                    expires_in: None,
                    response: None,
                    tier: Some(policy.name().to_owned()),
                    lease_expiry: Some(policy.lease_expiry),
                };
                Some(ClaimAnswer::Claim(Claim { acquired: true, took_over: false, reacquired: false, record }))
            }
        })
    };
    read().map_err(|e| CLAIM_IN_TX.failed(e))
}

/// `BEGIN` for a claim of `lease` inside the caller's transaction: without a quota, with the key's lock
/// ([`key_lock`]) tried in the same round trip, for [`CLAIM_IN_TX`]. Whether it was taken is kept, with
/// the lock, in the transaction's setting `idemstore.key_lock`, which the claim reads in a statement of
/// its own, so that its snapshot is taken after the lock. `None`: a plain `BEGIN` (under a quota, the
/// lock is taken with a slot, [`HOLD_KEY`]).
pub(crate) fn begin_statement(lease: &Lease) -> Option<sqlx::AssertSqlSafe<String>> {
    let lock = key_lock(&lease.digest());
    // An integer is all the statement is built from.
    lease.policy.quota.is_off().then(|| {
        sqlx::AssertSqlSafe(format!(
            "BEGIN; SELECT set_config('idemstore.key_lock', pg_try_advisory_xact_lock({lock})::text || ':{lock}', true)"
        ))
    })
}

/// The claim's statements on `conn`: [`CLAIM_NEW`] first when `new_key_first`, then the full claim
/// (under the quota when the policy has one; `live_keys` is the live-key limit this claim may use),
/// taking the key's lock (`lock`) inside the caller's transaction.
async fn claim_on(
    conn: &mut PgConnection,
    timeout: Duration,
    lease: &Lease,
    digest: KeyDigest,
    new_key_first: bool,
    live_keys: Option<i32>,
    lock: Option<i64>,
) -> Result<ClaimAnswer, StoreError> {
    let policy = &lease.policy;
    let quota = &policy.quota;
    let full = if quota.is_off() { &CLAIM } else { &CLAIM_UNDER_QUOTA };
    if new_key_first {
        let claim = claim_query(&CLAIM_NEW, lease, &digest).bind(lock);
        let row = statement::bounded(timeout, &CLAIM_NEW, claim.fetch_optional(&mut *conn)).await?;
        // No row: a record committed after the statement's snapshot; a record to re-acquire: the full
        // claim answers either.
        if let Some(row) = row {
            let claimed = decode_claim(&row, lease).map_err(|e| CLAIM_NEW.failed(e))?;
            if !matches!(&claimed, ClaimAnswer::Claim(claim) if !claim.acquired && claim.record.is_reacquired_by(&lease.fingerprint))
            {
                return Ok(claimed);
            }
        }
    }
    // A concurrent claim that committed after this statement's snapshot conflicts with the insert
    // but is invisible to `prior`: the statement returns no row, or `prior` as the snapshot saw it (a
    // record this claim would have re-acquired). The next attempt sees the winner.
    let mut attempt = 0;
    loop {
        let mut claim = claim_query(full, lease, &digest);
        if !quota.is_off() {
            let new_keys = quota.new_key_limit();
            claim = claim
                .bind(new_keys.map(|(n, _)| as_int4(n)))
                .bind(new_keys.map(|(_, window)| millis(window) as f64))
                .bind(live_keys);
        }
        let row = statement::bounded(timeout, full, claim.bind(lock).fetch_optional(&mut *conn)).await?;
        attempt += 1;
        if let Some(row) = row {
            let claimed = decode_claim(&row, lease).map_err(|e| full.failed(e))?;
            if let ClaimAnswer::Claim(claim) = &claimed
                && !claim.acquired
                && attempt < MAX_CLAIM_ATTEMPTS
                && claim.record.is_reacquired_by(&lease.fingerprint)
            {
                continue;
            }
            return Ok(claimed);
        }
    }
}

/// A claim statement with the parameters every claim binds (`$1`..`$11`).
fn claim_query<'q>(
    statement: &Statement,
    lease: &'q Lease,
    digest: &'q KeyDigest,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let policy = &lease.policy;
    sqlx::query(statement.sql)
        .bind(lease.scope.tenant())
        .bind(lease.scope.operation())
        .bind(lease.key.as_str())
        .bind(&lease.fingerprint.as_bytes()[..])
        .bind(&lease.owner)
        .bind(millis(policy.lease) as f64)
        .bind(policy.retention.map(|r| millis(r) as f64))
        .bind(policy.lease_expiry == LeaseExpiry::TakeOver)
        .bind(policy.name())
        .bind(policy.tombstone.map(|t| millis(t) as f64))
        .bind(digest.as_str())
}

/// A key's record as committed, or its live tombstone ([`LOOKUP`]), on `conn` (a pool, or a connection).
async fn lookup_on<'c>(
    conn: impl sqlx::PgExecutor<'c>,
    timeout: Duration,
    scope: &Scope,
    digest: KeyDigest,
) -> Result<Option<Record>, StoreError> {
    let lookup = sqlx::query(LOOKUP.sql).bind(digest.as_str()).bind(scope.tenant()).fetch_optional(conn);
    let row = statement::bounded(timeout, &LOOKUP, lookup).await?;
    row.as_ref().map(decode_record).transpose().map_err(|e| LOOKUP.failed(e))
}

/// A quota's limit as the statements take it: limits fit an int4 (`Quota::check` refused larger ones).
fn as_int4(limit: u32) -> i32 {
    i32::try_from(limit).unwrap_or(i32::MAX)
}

/// [`PostgresTier::notify`], for a claim given back ([`give_back`]).
pub(crate) async fn notify(pool: &PgPool, timeout: Duration, digest: &str) -> Result<(), StoreError> {
    let notify = sqlx::query(NOTIFY.sql).bind(super::wakeup::POSTGRES_CHANNEL).bind(digest);
    statement::bounded(timeout, &NOTIFY, notify.execute(pool)).await.map(drop)
}

/// Takes back a claim written for a caller who stopped waiting before it heard of it (a batch's, or a
/// lone claim's): a new record goes whole ([`FORGET`]), as if its statement had been cancelled, which is
/// what the caller was told; a record it re-acquired (`reacquired`) is released, as its owner's drop
/// would have. Claims that wait for the key (named `digest`) hear of it. Best effort: a claim that
/// cannot be given back (Postgres out of reach) stays until its lease runs out.
pub(crate) async fn give_back(pool: &PgPool, timeout: Duration, lease: &Lease, reacquired: bool, digest: &str) {
    // Fault tests: the give-back starts only after `return(ms)`.
    #[cfg(feature = "failpoints")]
    statement::pause_at("give-back").await;
    let statement = if reacquired { &RELEASE } else { &FORGET };
    let given_back = statement::bounded(timeout, statement, fenced(statement, lease).fetch_optional(pool)).await;
    let announced = match given_back {
        Ok(Some(row)) if row.try_get::<bool, _>("waited").unwrap_or(true) => notify(pool, timeout, digest).await,
        Ok(_) => Ok(()),
        Err(error) => Err(error),
    };
    if let Err(error) = announced {
        tracing::warn!(%error, fence = lease.fence, "could not give back a claim nobody waited for; its lease runs out instead");
    }
}

/// How long a completed record is kept, from [`retained_columns`].
pub(crate) fn retained(row: &PgRow) -> Result<Retained, sqlx::Error> {
    Ok(Retained { expires_in: millis_column(row, "expires_ms")?, waited: row.try_get("waited")? })
}

/// A write keyed by the lease's record (`$1`, its digest, and `$2`, its tenant) and fence (`$3`).
fn fenced<'q>(
    statement: &Statement,
    lease: &'q Lease,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(statement.sql).bind(lease.digest().as_str().to_owned()).bind(lease.scope.tenant()).bind(lease.fence)
}

/// The claim statement's row: the record, or the quota that held back a write the claim would have made
/// (for no record, or for one it would have re-acquired as read).
fn decode_claim(row: &PgRow, lease: &Lease) -> Result<ClaimAnswer, sqlx::Error> {
    let state: Option<i8> = row.try_get("state")?;
    let acquired: bool = row.try_get("acquired")?;
    // A live record of this very claim (a batch wrote it, and its caller never heard) is its own, whoever
    // holds the key's lock now.
    if !acquired && !row.try_get::<bool, _>("held")? {
        return Ok(ClaimAnswer::Held(state.map(|_| decode_record(row)).transpose()?));
    }
    let over_quota = match row.try_get::<Option<i8>, _>("quota_limit")? {
        Some(code) => {
            let limit = QuotaLimit::from_code(code as u8)
                .ok_or_else(|| sqlx::Error::Decode(format!("unknown quota limit {code}").into()))?;
            Some(ClaimAnswer::OverQuota {
                limit,
                retry_after: millis_column(row, "quota_retry_ms")?.unwrap_or_default(),
            })
        }
        None => None,
    };
    if state.is_none() {
        return over_quota.ok_or_else(|| sqlx::Error::Decode("a claim answered neither a record nor a quota".into()));
    }
    let record = decode_record(row)?;
    if let Some(over_quota) = over_quota.filter(|_| record.is_reacquired_by(&lease.fingerprint)) {
        return Ok(over_quota);
    }
    let prior: Option<i8> = row.try_get("prior_state")?;
    let took_over = acquired && prior == Some(State::InProgress.code() as i8);
    Ok(ClaimAnswer::Claim(Claim { acquired, took_over, reacquired: acquired && prior.is_some(), record }))
}

/// How often a claim is retried after losing a race, before the last answer stands ("in flight").
const MAX_CLAIM_ATTEMPTS: u32 = 4;

/// A column of milliseconds as a duration (negative values, which the queries never produce, as zero).
fn millis_column(row: &PgRow, column: &str) -> Result<Option<Duration>, sqlx::Error> {
    let value: Option<i64> = row.try_get(column)?;
    Ok(value.map(|v| Duration::from_millis(u64::try_from(v).unwrap_or(0))))
}

fn matched(result: sqlx::postgres::PgQueryResult) -> bool {
    result.rows_affected() == 1
}

pub(crate) fn decode_record(row: &PgRow) -> Result<Record, sqlx::Error> {
    let code: i8 = row.try_get("state")?;
    let state = State::from_code(code as u8)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown idempotency record state {code}").into()))?;
    let ms = |column: &str| millis_column(row, column);
    Ok(Record {
        state,
        fence: row.try_get("fence")?,
        fingerprint: row.try_get("fingerprint")?,
        lease_remaining: if state == State::InProgress { ms("lease_ms")? } else { None },
        expires_in: ms("expires_ms")?,
        response: row.try_get::<Option<Vec<u8>>, _>("response")?.map(StoredResponse::new),
        tier: row.try_get("tier")?,
        lease_expiry: row
            .try_get::<Option<i8>, _>("on_lease_expiry")?
            .and_then(|code| LeaseExpiry::from_code(code as u8)),
    })
}
