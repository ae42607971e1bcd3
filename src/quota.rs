//! Per-tenant quotas ([`Quota`]): how many keys one tenant may start under a policy.

use std::time::Duration;

use crate::error::ConfigError;

/// The longest window of a new-key limit: a year, with room for a leap day. Longer windows are a
/// retention question, not a rate.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// Limits on the keys one tenant may start under a policy (per operation), so that one tenant cannot
/// fill the store (or hold every worker) for everyone else. Off by default; set with
/// [`crate::PolicyBuilder::quota`] or in the policy file (`new_keys = "1000/1m"`, `live_keys = 50`).
///
/// Both limits are enforced in Postgres, inside the claim statement that would start a key: no extra
/// round trip in either mode, nothing in Redis (so the same limit holds in Postgres-only mode, with
/// Redis down, and on a Redis Cluster without a counter slot). Only a claim that would execute is
/// counted or refused; replays, duplicates in flight and mismatches are answered as before, from Redis
/// or Postgres. A refused claim leaves nothing behind.
///
/// - **New keys** are counted in `idempotency_quota_usage`, one row per tenant, operation, window of the
///   epoch and Postgres connection, and estimated over a sliding window (the previous window's count,
///   weighted by how much of it the sliding window still covers, plus the current one's). Reading it
///   costs a row per connection that counted in the last two windows, whatever the limit; no claim
///   waits for another connection's counter. Changing a policy's window starts its counts afresh.
/// - **Live keys** are counted from the tenant's in-progress records, at most `limit` index entries.
///   Claims open inside applications' transactions (`run_once_in_tx`, `Inbox::receive_in_tx`, the HTTP
///   layer's transactional path) are in no other snapshot until they commit: each holds one of `limit`
///   transaction-level advisory locks of the tenant and operation instead, so at most `limit` are open at
///   once, and they also count the committed leases. Claims outside transactions count the committed
///   leases only (reading the locks would be a scan of `pg_locks`, every lock partition, on every
///   claim): a tenant that uses both kinds at once holds at most twice the limit.
///
/// Counts are read in the claim's snapshot, so claims of one tenant that run at the same instant do not
/// see each other: a burst of `k` concurrent claims can pass a limit by at most `k - 1`, and a new key
/// claimed inside a transaction counts towards the new-key limit once that commits.
/// A duplicate of a key whose claim has not committed yet may be told [`crate::Begin::QuotaExceeded`]
/// rather than "in flight". Under `SERIALIZABLE`, concurrent claims of one tenant under a quota read
/// what the other writes, and one may fail with a serialization error (retry it). Sequential claims
/// outside transactions are held to the limits; a quota is abuse control, not billing.
///
/// ```
/// use std::time::Duration;
/// use idemstore::{Policy, Quota};
///
/// let quota = Quota::default().new_keys(1000, Duration::from_secs(60)).live_keys(50);
/// let policy = Policy::builder().quota(quota).build()?;
/// assert_eq!(policy.quota().live_key_limit(), Some(50));
/// # Ok::<(), idemstore::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    new_keys: Option<(u32, Duration)>,
    live_keys: Option<u32>,
}

impl Quota {
    /// About `limit` new keys started by one tenant per `window`, estimated over a sliding window from
    /// two fixed ones (see [`Quota`]: a burst straddling two windows can start somewhat more, an uneven
    /// previous window somewhat less). A key started again after a release or a takeover is not
    /// new.
    pub fn new_keys(mut self, limit: u32, window: Duration) -> Self {
        self.new_keys = Some((limit, window));
        self
    }

    /// At most `limit` keys of one tenant in progress at once (live leases; a lease that ran out does
    /// not count); claims open inside applications' transactions (`run_once_in_tx`) hold `limit` slots of
    /// their own, so with both kinds at once at most twice `limit` (see the type's documentation).
    pub fn live_keys(mut self, limit: u32) -> Self {
        self.live_keys = Some(limit);
        self
    }

    /// The new-key limit and its window, if one is set.
    pub fn new_key_limit(&self) -> Option<(u32, Duration)> {
        self.new_keys
    }

    /// The live-key limit, if one is set.
    pub fn live_key_limit(&self) -> Option<u32> {
        self.live_keys
    }

    /// No limit is set: claims send the statement without the quota's parts.
    pub(crate) fn is_off(&self) -> bool {
        self.new_keys.is_none() && self.live_keys.is_none()
    }

    /// Refuses limits of zero (a limit that refuses everything is a disabled route, not a quota) or of
    /// 2^31 and more (Postgres counts in `integer`), and windows shorter than a millisecond or longer than
    /// [`MAX_WINDOW`].
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let invalid = |reason| Err(ConfigError::Quota { reason });
        match (self.new_keys, self.live_keys) {
            (Some((0, _)), _) | (_, Some(0)) => invalid("a limit must be at least 1"),
            (Some((_, window)), _) if window < Duration::from_millis(1) => invalid("the window must be at least 1 ms"),
            (Some((_, window)), _) if window > MAX_WINDOW => invalid("the window must be at most 366 days"),
            (Some((limit, _)), _) | (_, Some(limit)) if i32::try_from(limit).is_err() => {
                invalid("a limit must be below 2^31")
            }
            _ => Ok(()),
        }
    }
}

/// Which limit of a [`Quota`] refused a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuotaLimit {
    /// [`Quota::new_keys`]: the tenant started its limit of keys within the window.
    NewKeys,
    /// [`Quota::live_keys`]: the tenant has its limit of keys in progress.
    LiveKeys,
}

impl QuotaLimit {
    /// The limit's name in metrics and problem details (`new_keys`, `live_keys`).
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaLimit::NewKeys => "new_keys",
            QuotaLimit::LiveKeys => "live_keys",
        }
    }

    /// The one-byte code the claim statement answers with.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            b'n' => Some(QuotaLimit::NewKeys),
            b'l' => Some(QuotaLimit::LiveKeys),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_limits_and_empty_windows_are_refused() {
        let minute = Duration::from_secs(60);
        assert!(Quota::default().check().is_ok());
        assert!(Quota::default().new_keys(1, minute).live_keys(1).check().is_ok());
        assert!(Quota::default().new_keys(0, minute).check().is_err());
        assert!(Quota::default().live_keys(0).check().is_err());
        assert!(Quota::default().new_keys(5, Duration::from_micros(10)).check().is_err());
        assert!(Quota::default().new_keys(5, MAX_WINDOW).check().is_ok());
        assert!(Quota::default().new_keys(5, Duration::MAX).check().is_err());
        assert!(Quota::default().live_keys(u32::MAX).check().is_err());
        assert!(Quota::default().new_keys(5, Duration::from_secs(60)).live_keys(u32::MAX).check().is_err());
        assert!(Quota::default().new_keys(i32::MAX as u32, MAX_WINDOW).check().is_ok());
    }
}
