//! The due list of one pass: the `due-for-poll` index's shards merged, oldest first.

use relay_shared::store::{DueTask, PollIndex};
use relay_shared::time::Timestamp;

/// The due list, oldest first across every shard (a k-way merge of per-shard index pages), so
/// no shard waits while another drains.
pub(crate) struct DueStream<'a> {
    store: &'a PollIndex,
    now: Timestamp,
    page_size: i32,
    shards: Vec<ShardCursor>,
    pub(crate) errors: u64,
}

struct ShardCursor {
    shard: u8,
    buffered: std::collections::VecDeque<DueTask>,
    next_page: Option<relay_shared::store::PageKey>,
    done: bool,
}

impl<'a> DueStream<'a> {
    pub(crate) fn new(store: &'a PollIndex, now: Timestamp, page_size: i32) -> Self {
        let shards = (0..store.shards().read())
            .map(|shard| ShardCursor { shard, buffered: Default::default(), next_page: None, done: false })
            .collect();
        Self { store, now, page_size, shards, errors: 0 }
    }

    pub(crate) async fn next(&mut self) -> Option<DueTask> {
        // Every shard that needs a page gets it at once: a pass's first listing is one round trip.
        let (store, now, page_size) = (self.store, self.now, self.page_size);
        let refills = self.shards.iter_mut().filter(|c| c.buffered.is_empty() && !c.done).map(|c| async move {
            let page = store.due_page(c.shard, now, page_size, c.next_page.take()).await;
            (c, page)
        });
        for (c, page) in futures_util::future::join_all(refills).await {
            match page {
                Ok(page) => {
                    c.done = page.next.is_none();
                    c.next_page = page.next;
                    c.buffered.extend(page.tasks);
                }
                Err(e) => {
                    tracing::error!(event = "poll_query_failed", shard = c.shard, error = %e);
                    self.errors += 1;
                    c.done = true;
                }
            }
        }
        let oldest = self
            .shards
            .iter_mut()
            .filter(|c| !c.buffered.is_empty())
            .min_by_key(|c| c.buffered.front().map(|d| d.due_at))?;
        oldest.buffered.pop_front()
    }
}
