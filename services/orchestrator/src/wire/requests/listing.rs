//! `ListRuns` requests: the filters, checked; the caller's scope and the page are `Core`'s.

use proto::orchestrator::v1 as pb;

use super::invalid;
use crate::Error;
use crate::domain::RunStatus;
use crate::domain::ids;
use crate::domain::listing::ListRequest;

impl TryFrom<pb::ListRunsRequest> for ListRequest {
    type Error = Error;

    fn try_from(r: pb::ListRunsRequest) -> Result<Self, Error> {
        let mut statuses = Vec::with_capacity(r.statuses.len());
        for value in r.statuses {
            let status = RunStatus::from_wire(value).map_err(|_| {
                invalid(format!(
                    "statuses: {value} is not a RunStatus (RUNNING, COMPLETED, FAILED, CANCELED or AWAITING_APPROVAL)"
                ))
            })?;
            if !statuses.contains(&status) {
                statuses.push(status);
            }
        }
        let (after, before) = (
            time("created_after_ms", r.created_after_ms)?,
            time("created_before_ms", r.created_before_ms)?,
        );
        if let (Some(after), Some(before)) = (after, before)
            && after >= before
        {
            return Err(invalid(format!(
                "created_after_ms ({after}) must be before created_before_ms ({before})"
            )));
        }
        Ok(Self {
            statuses,
            thread_id: id("thread_id", r.thread_id)?,
            principal: Some(r.principal).filter(|p| !p.is_empty()),
            labels: r.labels.into_iter().collect(),
            created_after_ms: after,
            created_before_ms: before,
            agent: id("agent", r.agent)?,
            page_size: usize::try_from(r.page_size).unwrap_or(usize::MAX),
            page_token: Some(r.page_token).filter(|t| !t.is_empty()),
        })
    }
}

/// A time filter: 0 is none, a negative one is refused.
fn time(field: &str, ms: i64) -> Result<Option<u64>, Error> {
    match u64::try_from(ms) {
        Ok(0) => Ok(None),
        Ok(ms) => Ok(Some(ms)),
        Err(_) => Err(invalid(format!(
            "{field} must be a Unix time in ms (or 0 for no bound), not {ms}"
        ))),
    }
}

/// An id filter, by the rules ids are made by (empty: none).
fn id(field: &str, value: String) -> Result<Option<String>, Error> {
    if value.is_empty() {
        return Ok(None);
    }
    ids::check(field, &value).map_err(|e| invalid(format!("{e} (or empty for any)")))?;
    Ok(Some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::ListRunsRequest {
        pb::ListRunsRequest::default()
    }

    #[test]
    fn an_empty_request_lists_everything_it_may() {
        assert_eq!(ListRequest::try_from(request()).unwrap(), ListRequest::default());
    }

    #[test]
    fn bad_filters_are_refused_naming_the_field() {
        let cases = [
            (
                pb::ListRunsRequest {
                    statuses: vec![0],
                    ..request()
                },
                "statuses",
            ),
            (
                pb::ListRunsRequest {
                    statuses: vec![99],
                    ..request()
                },
                "statuses",
            ),
            (
                pb::ListRunsRequest {
                    thread_id: "ünï".into(),
                    ..request()
                },
                "thread_id",
            ),
            (
                pb::ListRunsRequest {
                    thread_id: "t".repeat(129),
                    ..request()
                },
                "thread_id",
            ),
            (
                pb::ListRunsRequest {
                    created_after_ms: -1,
                    ..request()
                },
                "created_after_ms",
            ),
            (
                pb::ListRunsRequest {
                    created_after_ms: 5,
                    created_before_ms: 5,
                    ..request()
                },
                "created_after_ms",
            ),
        ];
        for (bad, field) in cases {
            match ListRequest::try_from(bad.clone()) {
                Err(Error::InvalidArgument(message)) => assert!(message.contains(field), "{message}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let fits = pb::ListRunsRequest {
            thread_id: "t".repeat(128),
            statuses: vec![5, 5, 1],
            created_after_ms: 4,
            created_before_ms: 5,
            ..request()
        };
        let checked = ListRequest::try_from(fits).unwrap();
        assert_eq!(checked.statuses, [RunStatus::AwaitingApproval, RunStatus::Running]);
    }
}
