//! `ListRuns`: the store's index lists the runs, given the runs live on this replica as they
//! are now (a store that keeps no live runs lists them from here; one that does shows them so,
//! fresher than their last record).

use crate::domain::RunStatus;
use crate::domain::listing::{RunPage, RunQuery, RunSummary};
use crate::domain::ports::{StoreError, within};

use super::{Live, Runs};

impl Live {
    /// The run's row as readers outside it see it (see [`Live::shown`]), as of now.
    fn summary(&self) -> RunSummary {
        let mut row = RunSummary::from(&*shared::sync::lock(&self.state));
        if !self.ownership().ended() && !row.status.is_live() {
            row.status = RunStatus::Running;
            row.failure_reason = None;
        }
        row.updated_at_ms = shared::sync::unix_ms();
        row
    }
}

impl Runs {
    /// A page of the runs `query` asks for (already scoped to what its caller may see).
    pub(crate) async fn list(&self, query: RunQuery) -> Result<RunPage, StoreError> {
        let mut here: Vec<RunSummary> = self.lock().values().map(Live::summary).collect();
        if let Some(local) = self.approvals.local() {
            here.extend(local.parked_runs().iter().map(RunSummary::from));
        }
        within(self.store_timeout, self.index.list(query, here)).await
    }
}
