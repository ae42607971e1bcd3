//! Per-operation policy: how long an owner holds a key, how long each tier keeps a result, and what a
//! lease that ran out means.

use std::borrow::Cow;
use std::time::Duration;

use crate::error::ConfigError;
use crate::fingerprint::FingerprintOptions;
use crate::quota::Quota;

/// What a new request finds when the previous owner's lease ran out before it completed or released.
/// Serialized (policy files, JSON) and stored by its [`LeaseExpiry::as_str`] name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum LeaseExpiry {
    /// Re-execute under a new, higher fence; the old owner can no longer complete. Right when the work
    /// is safe to repeat after a crash (it is itself idempotent downstream, or transactional).
    #[default]
    TakeOver,
    /// Mark the record indeterminate and execute nothing until an operator or reconciler resolves it.
    /// Right when a second execution costs more than a stuck key (money movement without a downstream key).
    MarkIndeterminate,
}

impl LeaseExpiry {
    /// The name stored with each record (`take_over`, `mark_indeterminate`).
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseExpiry::TakeOver => "take_over",
            LeaseExpiry::MarkIndeterminate => "mark_indeterminate",
        }
    }

    /// The one-byte code Postgres stores (a `"char"`).
    pub(crate) fn code(self) -> u8 {
        match self {
            LeaseExpiry::TakeOver => b't',
            LeaseExpiry::MarkIndeterminate => b'm',
        }
    }

    /// The rule of a stored code; `None` for a code this version does not know.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [LeaseExpiry::TakeOver, LeaseExpiry::MarkIndeterminate].into_iter().find(|rule| rule.code() == code)
    }

    /// The rule of a name (as `as_str` spells it); `None` for a name this version does not know.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "take_over" => Some(LeaseExpiry::TakeOver),
            "mark_indeterminate" => Some(LeaseExpiry::MarkIndeterminate),
            _ => None,
        }
    }
}

/// Named presets of lease and retention, for endpoints with different retry windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Tier {
    /// Short-lived actions: Redis 5 min, Postgres 1 h, then a tombstone for 24 h.
    Ephemeral,
    /// The default: Redis 1 h, Postgres 24 h, then a tombstone for 7 days.
    Standard,
    /// Webhook receivers, whose senders retry for days: Redis 1 h, Postgres 7 days, then a tombstone for
    /// 30 days.
    Webhook,
    /// Ledger entries: Redis 24 h, Postgres forever.
    Ledger,
}

/// How the store treats one operation. Build with [`Policy::builder`] or start from [`Policy::tier`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub(crate) name: Cow<'static, str>,
    pub(crate) lease: Duration,
    pub(crate) redis_ttl: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) tombstone: Option<Duration>,
    pub(crate) lease_expiry: LeaseExpiry,
    pub(crate) fingerprint: FingerprintOptions,
    pub(crate) quota: Quota,
}

impl Default for Policy {
    fn default() -> Self {
        Self::tier(Tier::Standard)
    }
}

const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

impl Tier {
    /// The preset's name, recorded with every record stored under it.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Ephemeral => "ephemeral",
            Tier::Standard => "standard",
            Tier::Webhook => "webhook",
            Tier::Ledger => "ledger",
        }
    }
}

impl Policy {
    /// A builder starting from the [`Tier::Standard`] preset.
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder(Self::default())
    }

    /// The preset for `tier`, with a 30 s lease and [`LeaseExpiry::TakeOver`].
    pub fn tier(tier: Tier) -> Self {
        let (redis_ttl, retention, tombstone) = match tier {
            Tier::Ephemeral => (5 * MINUTE, Some(HOUR), Some(DAY)),
            Tier::Standard => (HOUR, Some(DAY), Some(7 * DAY)),
            Tier::Webhook => (HOUR, Some(7 * DAY), Some(30 * DAY)),
            Tier::Ledger => (24 * HOUR, None, None),
        };
        Self {
            name: Cow::Borrowed(tier.name()),
            lease: Duration::from_secs(30),
            redis_ttl,
            retention,
            tombstone,
            lease_expiry: LeaseExpiry::TakeOver,
            fingerprint: FingerprintOptions::default(),
            quota: Quota::default(),
        }
    }

    /// The policy's name (its tier's, unless renamed), recorded with every record stored under it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long an owner holds a key before others may act on it (see [`LeaseExpiry`]).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// How long Redis keeps a completed result.
    pub fn redis_ttl(&self) -> Duration {
        self.redis_ttl
    }

    /// How long Postgres keeps a record; `None` keeps it forever.
    pub fn retention(&self) -> Option<Duration> {
        self.retention
    }

    /// How long a completed key still answers [`crate::Begin::Expired`] after its record was purged (a
    /// compact tombstone, counted from the end of the retention); `None` keeps the tombstone forever.
    /// `Some(Duration::ZERO)` keeps none: once a completed record's retention ends, its key is free for
    /// a new request at once, purged or not (the window of key-less deduplication,
    /// [`DerivedKeys`](crate::DerivedKeys)). Only a record claimed under a policy without
    /// tombstones is freed so, by any caller whose policy has none: a record claimed under a policy that
    /// keeps tombstones stays expired, whatever the asking caller's policy.
    pub fn tombstone(&self) -> Option<Duration> {
        self.tombstone
    }

    /// What a lease that ran out means.
    pub fn lease_expiry(&self) -> LeaseExpiry {
        self.lease_expiry
    }

    /// How payloads are fingerprinted.
    pub fn fingerprint(&self) -> &FingerprintOptions {
        &self.fingerprint
    }

    /// The limits on keys one tenant may start under this policy (none by default).
    pub fn quota(&self) -> &Quota {
        &self.quota
    }
}

/// Builds a [`Policy`]; [`PolicyBuilder::build`] checks that the durations make sense together.
#[derive(Clone, Debug)]
pub struct PolicyBuilder(Policy);

impl PolicyBuilder {
    /// Starts from a preset instead of [`Tier::Standard`].
    pub fn tier(mut self, tier: Tier) -> Self {
        let Policy { lease, lease_expiry, fingerprint, quota, .. } = self.0;
        self.0 = Policy { lease, lease_expiry, fingerprint, quota, ..Policy::tier(tier) };
        self
    }

    /// Names the policy (default: its tier's name), as recorded with each record.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.0.name = Cow::Owned(name.into());
        self
    }

    /// In-progress lease (default 30 s). Owners running longer should extend it (`run_once` does).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.0.lease = lease;
        self
    }

    /// How long Redis keeps a completed result.
    pub fn redis_ttl(mut self, ttl: Duration) -> Self {
        self.0.redis_ttl = ttl;
        self
    }

    /// How long Postgres keeps a record; `None` keeps it forever.
    pub fn retention(mut self, retention: Option<Duration>) -> Self {
        self.0.retention = retention;
        self
    }

    /// How long a tombstone answers [`crate::Begin::Expired`] once the record was purged, counted from
    /// the end of the retention; `None` keeps it forever, `Some(Duration::ZERO)` keeps none and frees the
    /// key when the retention ends (see [`Policy::tombstone`]).
    pub fn tombstone(mut self, horizon: Option<Duration>) -> Self {
        self.0.tombstone = horizon;
        self
    }

    /// What a lease that ran out means (default [`LeaseExpiry::TakeOver`]).
    pub fn lease_expiry(mut self, lease_expiry: LeaseExpiry) -> Self {
        self.0.lease_expiry = lease_expiry;
        self
    }

    /// Fingerprint limits and ignored fields.
    pub fn fingerprint(mut self, options: FingerprintOptions) -> Self {
        self.0.fingerprint = options;
        self
    }

    /// Limits on the keys one tenant may start under this policy (see [`Quota`]); beyond them a claim
    /// that would execute answers [`crate::Begin::QuotaExceeded`] and nothing runs.
    pub fn quota(mut self, quota: Quota) -> Self {
        self.0.quota = quota;
        self
    }

    /// Checks the policy: durations of at least a millisecond, a lease shorter than either tier keeps a
    /// result, Redis never promising a result longer than Postgres keeps it, and quota limits from 1 to
    /// 2^31 - 1 over windows from a millisecond to 366 days.
    ///
    /// # Errors
    /// [`ConfigError`] saying which rule was broken.
    pub fn build(self) -> Result<Policy, ConfigError> {
        let p = self.0;
        let too_short = |d: Duration| d < Duration::from_millis(1);
        if too_short(p.lease) || too_short(p.redis_ttl) || p.retention.is_some_and(too_short) {
            return Err(ConfigError::TooShort);
        }
        // Past this, Redis refuses the expiry (now + TTL overflows its clock) and every completion would
        // open the circuit; "forever" is `None`, not a huge duration.
        let durations = [("lease", Some(p.lease)), ("redis_ttl", Some(p.redis_ttl)), ("retention", p.retention)];
        for (setting, duration) in durations.into_iter().chain([("tombstone", p.tombstone)]) {
            if duration.is_some_and(|d| d > MAX_POLICY_DURATION) {
                return Err(ConfigError::TooLong { setting, max: MAX_POLICY_DURATION });
            }
        }
        if p.lease >= p.redis_ttl {
            return Err(ConfigError::LeaseOutlivesRedisTtl { lease: p.lease, redis_ttl: p.redis_ttl });
        }
        if let Some(retention) = p.retention
            && p.redis_ttl > retention
        {
            return Err(ConfigError::RedisTtlOutlivesRetention { redis_ttl: p.redis_ttl, retention });
        }
        p.quota.check()?;
        Ok(p)
    }
}

impl From<Policy> for PolicyBuilder {
    /// A builder starting from an existing policy.
    fn from(policy: Policy) -> Self {
        PolicyBuilder(policy)
    }
}

/// The longest lease, Redis TTL, retention or tombstone horizon a policy takes: about 100 years.
pub(crate) const MAX_POLICY_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Milliseconds for SQL and Redis arguments, saturating rather than wrapping on absurd durations.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_pass_their_own_validation() {
        for tier in [Tier::Ephemeral, Tier::Standard, Tier::Webhook, Tier::Ledger] {
            let built = Policy::builder().tier(tier).build().expect("preset is valid");
            assert_eq!(built, Policy::tier(tier));
        }
        assert_eq!(Policy::tier(Tier::Ledger).retention(), None);
    }

    #[test]
    fn inconsistent_durations_are_refused() {
        let s = Duration::from_secs;
        assert!(Policy::builder().lease(s(3600)).build().is_err());
        assert!(Policy::builder().redis_ttl(s(48 * 3600)).build().is_err());
        assert!(Policy::builder().lease(Duration::ZERO).build().is_err());
        assert!(Policy::builder().retention(Some(Duration::ZERO)).build().is_err());
        assert!(Policy::builder().retention(None).redis_ttl(s(48 * 3600)).build().is_ok());
    }
}
