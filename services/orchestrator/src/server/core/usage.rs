//! Each principal's spend as `Core` answers for it: a run refused while its caller's hour is
//! spent (`tokens_per_hour`), and `GetUsage`.

use std::time::Duration;

use shared::auth::Principal;

use super::Core;
use crate::Error;
use crate::domain::ports::within;
use crate::domain::usage::{Tally, WINDOW_MS, window_of};

/// The span `GetUsage` reads when the request names none.
const DEFAULT_SPAN: Duration = Duration::from_secs(24 * 3600);

/// A principal's spend over a span.
pub(crate) struct Spent {
    pub principal: String,
    pub windows: Vec<(u64, Tally)>,
    pub total: Tally,
    pub tokens_per_hour: Option<u64>,
}

impl Core {
    /// `HourSpent` when `caller` has spent its `tokens_per_hour` in this hour already: the run
    /// is not let in (the time the budget resets is in the answer). A store that cannot be read
    /// lets it in (logged).
    pub(crate) async fn within_hourly_budget(&self, caller: &Principal) -> Result<(), Error> {
        let Some(budget) = caller.tokens_per_hour else {
            return Ok(());
        };
        let window = window_of(shared::sync::unix_ms());
        let read = self.deps.usage.read(&caller.name, window, window);
        let spent = match within(self.config.store.timeout, read).await {
            Ok(windows) => windows.first().map_or(0, |(_, tally)| tally.tokens()),
            Err(e) => {
                tracing::warn!(principal = %caller.name, "the caller's usage could not be read: {e}");
                return Ok(());
            }
        };
        if spent < budget {
            return Ok(());
        }
        let resets = std::time::UNIX_EPOCH + Duration::from_millis(window + WINDOW_MS);
        Err(Error::HourSpent {
            principal: caller.name.clone(),
            spent,
            budget,
            resets: humantime::format_rfc3339_seconds(resets).to_string(),
        })
    }

    /// What `principal` (the caller's own when `None`; another's for an operator) spent from
    /// `from_ms` to `to_ms` (0: 24 hours before the end; 0: now), at most `--usage-max-range`.
    pub(crate) async fn usage(
        &self,
        caller: &Principal,
        principal: Option<String>,
        (from_ms, to_ms): (u64, u64),
    ) -> Result<Spent, Error> {
        let principal = principal.unwrap_or_else(|| caller.name.clone());
        let operator = caller.is_anonymous() || caller.has_role(shared::auth::OPERATOR);
        if principal != caller.name && !operator {
            return Err(Error::PermissionDenied(format!(
                "the usage of {principal:?} needs the \"{}\" role in the tokens file; leave principal empty for your own",
                shared::auth::OPERATOR
            )));
        }
        let to = if to_ms == 0 { shared::sync::unix_ms() } else { to_ms };
        let span = u64::try_from(DEFAULT_SPAN.as_millis()).unwrap_or(u64::MAX);
        let from = if from_ms == 0 { to.saturating_sub(span) } else { from_ms };
        let max = self.config.store.usage_max_range;
        if from > to || Duration::from_millis(to - from) > max {
            return Err(Error::InvalidArgument(format!(
                "from_ms {from} to to_ms {to} must be a span of at most {} (--usage-max-range), from before to",
                humantime::format_duration(max)
            )));
        }
        let read = self.deps.usage.read(&principal, window_of(from), window_of(to));
        let windows = within(self.config.store.timeout, read).await?;
        let mut total = Tally::default();
        for (_, tally) in &windows {
            total.add(tally);
        }
        let tokens_per_hour = (principal == caller.name).then_some(caller.tokens_per_hour).flatten();
        Ok(Spent {
            principal,
            windows,
            total,
            tokens_per_hour,
        })
    }
}
