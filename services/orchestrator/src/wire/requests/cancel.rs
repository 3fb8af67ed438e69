//! `CancelRun` requests: the run and when it stops.

use proto::orchestrator::v1 as pb;

use super::invalid;
use crate::Error;
use crate::domain::CancelMode;

/// A `CancelRun` request, checked.
pub(crate) struct CancelRequest {
    pub run_id: String,
    pub mode: CancelMode,
}

impl TryFrom<pb::CancelRunRequest> for CancelRequest {
    type Error = Error;

    fn try_from(request: pb::CancelRunRequest) -> Result<Self, Error> {
        let mode = match pb::CancelMode::try_from(request.mode) {
            Ok(pb::CancelMode::Unspecified | pb::CancelMode::Immediate) => CancelMode::Immediate,
            Ok(pb::CancelMode::AfterTurn) => CancelMode::AfterTurn,
            Err(_) => {
                return Err(invalid(format!(
                    "mode = {} is not a CancelMode (CANCEL_MODE_IMMEDIATE or CANCEL_MODE_AFTER_TURN)",
                    request.mode
                )));
            }
        };
        Ok(Self {
            run_id: super::named_id("run_id", request.run_id)?,
            mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mode_unset_is_immediate_and_an_unknown_one_is_refused_naming_the_field() {
        let request = |mode: i32| pb::CancelRunRequest {
            run_id: "r".into(),
            mode,
        };
        let mode = |m| CancelRequest::try_from(request(m)).map(|r| r.mode).ok();
        assert_eq!(mode(0), Some(CancelMode::Immediate));
        assert_eq!(mode(1), Some(CancelMode::Immediate));
        assert_eq!(mode(2), Some(CancelMode::AfterTurn));
        let refused = CancelRequest::try_from(request(7)).err().map(|e| e.to_string());
        assert!(refused.is_some_and(|e| e.contains("mode = 7")));
    }
}
