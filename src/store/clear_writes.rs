//! Whether a store without encryption may write responses in clear: not where the deployment seals
//! them, or every store with the key would refuse to replay what it wrote. Asked of Postgres (a sample of
//! the most recent responses) at the store's first claim or resolve, remembered, and asked again now and
//! then while the answer is "nothing sealed".

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Statement, Store};
use crate::encryption::{SEALED, SEALING_OVERHEAD};
use crate::error::{EncryptionError, StoreError};

/// How long "nothing sealed" holds before the next claim asks again (a deployment that starts sealing,
/// a store that first asked an empty table).
const RECHECK_AFTER: Duration = Duration::from_secs(60);

/// The responses of the records that expire last, through the purge's index (`$1`: the format's first
/// bytes, `$2`: the least a sealed response takes): how the deployment writes now, whatever the tenant
/// and operation, without scanning the table.
const RECENT_SAMPLE: Statement = Statement::new(
    "sealed_sample",
    "
    SELECT count(*), count(*) FILTER (WHERE octet_length(response) >= $2 AND substring(response FROM 1 FOR 2) = $1)
    FROM (SELECT response FROM idempotency_records
          WHERE expires_at IS NOT NULL AND response IS NOT NULL ORDER BY expires_at DESC LIMIT 16) sample",
);

/// Records kept forever (the ledger tier) have no expiry to order by: any 16 of them, asked only when
/// no expiring record holds a response (the scan then meets kept records first).
const KEPT_SAMPLE: Statement = Statement::new(
    "sealed_sample",
    "
    SELECT count(*), count(*) FILTER (WHERE octet_length(response) >= $2 AND substring(response FROM 1 FOR 2) = $1)
    FROM (SELECT response FROM idempotency_records
          WHERE expires_at IS NULL AND response IS NOT NULL LIMIT 16) sample",
);

/// What a store without encryption last learned: `None` until asked; "sealed" is kept for good (the
/// store refuses until it is rebuilt with the key), "nothing sealed" for [`RECHECK_AFTER`].
#[derive(Debug, Default)]
pub(crate) struct SealedDeployment(Mutex<Option<(Instant, bool)>>);

impl Store {
    /// Refuses a write in clear where the deployment seals its responses ([`SealedDeployment`]); a
    /// store with encryption, or built with `clear_responses_allowed`, never asks. Concurrent first
    /// claims ask at once, each bounded by the Postgres timeout.
    ///
    /// # Errors
    /// [`EncryptionError::WouldWriteClear`] where a sealed response was found; [`StoreError::
    /// StoreUnavailable`] if Postgres could not be asked and the store never learned the answer.
    pub(crate) async fn refuse_clear_writes(&self) -> Result<(), StoreError> {
        let Some(known) = &self.inner.sealed_deployment else { return Ok(()) };
        let last = *known.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match last {
            Some((_, true)) => return Err(EncryptionError::WouldWriteClear.into()),
            Some((asked, false)) if asked.elapsed() < RECHECK_AFTER => return Ok(()),
            _ => {}
        }
        let sealed = match self.sample_sealed().await {
            Ok(sealed) => sealed,
            // Nothing was sealed when last asked: the claim goes on (and fails on its own if Postgres is
            // down); never asked, the store cannot tell, and claims nothing.
            Err(_) if last.is_some() => false,
            Err(error) => return Err(error),
        };
        let mut known = known.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if sealed && !known.is_some_and(|(_, sealed)| sealed) {
            tracing::error!(
                "this store has no encryption key, and the deployment's stored responses are encrypted: it \
                 refuses every claim (configure the key, or StoreBuilder::clear_responses_allowed)"
            );
        }
        *known = Some((Instant::now(), sealed));
        if sealed { Err(EncryptionError::WouldWriteClear.into()) } else { Ok(()) }
    }

    /// Whether a sample of the most recent stored responses holds a sealed one.
    async fn sample_sealed(&self) -> Result<bool, StoreError> {
        let mut seen = 0;
        for statement in [&RECENT_SAMPLE, &KEPT_SAMPLE] {
            let query = sqlx::query_as::<_, (i64, i64)>(statement.sql)
                .bind(&SEALED[..])
                .bind(SEALING_OVERHEAD as i32)
                .fetch_one(self.pg_pool());
            let (sampled, sealed) = self.bounded(statement, query).await?;
            if sealed > 0 {
                return Ok(true);
            }
            seen += sampled;
            if seen > 0 {
                break;
            }
        }
        Ok(false)
    }
}
