//! Client side of UpdateLog (the forge acknowledges rows by index): a buffer of unacknowledged rows
//! starting at `offset`, the last index the server acknowledged.

use std::time::SystemTime;

use jr_forge::ForgeClient;
use jr_forge::proto::runner::v1::{LogRow, UpdateLogRequest};

use crate::ExecutorError;

/// Absolute-indexed task log with act_runner's ack handling.
#[derive(Debug)]
pub(crate) struct LogUploader {
    /// Task id put into requests (wrong on purpose under `Misbehaviour::WrongTaskId`).
    task_id: i64,
    /// Rows the server has acknowledged; index of `buffer[0]`.
    offset: i64,
    buffer: Vec<LogRow>,
}

impl LogUploader {
    pub(crate) fn new(task_id: i64) -> LogUploader {
        LogUploader {
            task_id,
            offset: 0,
            buffer: Vec::new(),
        }
    }

    /// Appends one row (one line, no newline) stamped with the current time.
    pub(crate) fn push(&mut self, content: impl Into<String>) {
        let time = prost_types::Timestamp::from(SystemTime::now());
        self.buffer.push(LogRow {
            time: Some(time),
            content: content.into(),
        });
    }

    /// Absolute index the next pushed row will get.
    pub(crate) fn next_index(&self) -> i64 {
        self.offset + len_i64(self.buffer.len())
    }

    /// Rows acknowledged by the server so far.
    pub(crate) fn acknowledged(&self) -> i64 {
        self.offset
    }

    /// One `UpdateLog{index: offset, rows: buffer, no_more}` attempt. Drops acknowledged rows.
    /// With `no_more`, succeeds only when every row was acknowledged. Without `no_more` and with
    /// nothing buffered, sends nothing.
    pub(crate) async fn flush(
        &mut self,
        client: &ForgeClient,
        no_more: bool,
    ) -> Result<(), ExecutorError> {
        if self.buffer.is_empty() && !no_more {
            return Ok(());
        }
        let sent = self.buffer.len();
        let request = UpdateLogRequest {
            task_id: self.task_id,
            index: self.offset,
            rows: self.buffer.clone(),
            no_more,
        };
        let reply = client
            .update_log(&request)
            .await
            .map_err(|source| ExecutorError::Rpc {
                call: "UpdateLog",
                source,
            })?;
        let ack = reply.ack_index;
        let end = self.offset + len_i64(sent);
        if ack < self.offset || ack > end {
            // Below offset: rows the server had acknowledged are gone ("submitted logs are
            // lost"). Beyond what was sent: the server counts rows it never got from us.
            return Err(ExecutorError::LogAck {
                ack,
                offset: self.offset,
                sent,
            });
        }
        let dropped = usize::try_from(ack - self.offset).unwrap_or(sent);
        self.buffer.drain(..dropped.min(sent));
        self.offset = ack;
        if no_more && ack < end {
            return Err(ExecutorError::LogAck {
                ack,
                offset: end - len_i64(sent),
                sent,
            });
        }
        Ok(())
    }
}

fn len_i64(len: usize) -> i64 {
    i64::try_from(len).unwrap_or(i64::MAX)
}
