//! Publishing envelopes with readable headers, dedupe ids and trace context; once-only facts;
//! reading the last fact on a subject.

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::{PublishMessage, StreamMessage};
use async_nats::jetstream::stream::{DirectGetErrorKind, LastRawMessageErrorKind};
use jr_protocol::subject::{self, ParsedSubject};
use jr_protocol::{Envelope, header};
use tokio_util::sync::CancellationToken;

use crate::bus::Bus;
use crate::error::{BusError, PublishFailure};
use crate::metrics::BusMetrics;
use crate::retry::retry_transient;
use crate::trace;

/// The server's answer to a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishOutcome {
    pub stream_seq: u64,
    /// The stream already held a message with this `Nats-Msg-Id` (inside the dedupe window);
    /// nothing new was stored and `stream_seq` is the earlier message's.
    pub duplicate: bool,
}

/// The answer to a once-only publish (`claimed`, `terminal`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOnce {
    /// This call stored the fact.
    Published { seq: u64 },
    /// The fact with this very message id is already stored (an earlier attempt of ours).
    Duplicate { seq: u64 },
    /// Another message (a different id) already holds the subject: the first writer won.
    AlreadyExists { seq: u64 },
}

fn failure_of(error: &PublishError) -> PublishFailure {
    match error.kind() {
        PublishErrorKind::TimedOut => PublishFailure::Timeout,
        PublishErrorKind::StreamNotFound => PublishFailure::NoResponders,
        PublishErrorKind::BrokenPipe => PublishFailure::Disconnected,
        PublishErrorKind::MaxAckPending => PublishFailure::Backpressure,
        PublishErrorKind::WrongLastSequence => PublishFailure::WrongLastSequence,
        PublishErrorKind::Other if refused_for_space(error) => PublishFailure::StreamFull,
        PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::Other => PublishFailure::Other,
        // async-nats adds kinds now and then; unknown ones are not retried.
        #[allow(
            unreachable_patterns,
            reason = "PublishErrorKind is not exhaustive upstream"
        )]
        _ => PublishFailure::Other,
    }
}

/// True when the server refused the message for want of space: the stream's own limits with
/// `discard: new` (error 10077, "maximum messages exceeded", "maximum bytes exceeded", "maximum
/// messages per subject exceeded") or the account's or server's JetStream storage (10023, 10047,
/// 10002).
fn refused_for_space(error: &PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    let Some(server) = std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
    else {
        return false;
    };
    match server.error_code() {
        ErrorCode::STREAM_STORE_FAILED => server.to_string().contains("maximum"),
        ErrorCode::INSUFFICIENT_RESOURCES
        | ErrorCode::STORAGE_RESOURCES_EXCEEDED
        | ErrorCode::ACCOUNT_RESOURCES_EXCEEDED => true,
        _ => false,
    }
}

/// Headers repeating the readable parts of an envelope, so the NATS CLI shows what a message is.
fn headers_for(subject: &str, envelope: &Envelope) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, envelope.id.as_str());
    headers.insert(header::KIND, envelope.kind().as_str());
    headers.insert(
        header::ASSIGNMENT,
        envelope.assignment_id.to_string().as_str(),
    );
    headers.insert(header::ATTEMPT, envelope.attempt.to_string().as_str());
    let backend = match subject::parse(subject) {
        Ok(ParsedSubject::Assignment { backend, .. } | ParsedSubject::Event { backend, .. }) => {
            Some(backend.as_str().to_owned())
        }
        Ok(ParsedSubject::Command { target, .. }) if target != subject::SCHEDULER_TARGET => {
            Some(target)
        }
        Ok(ParsedSubject::Command { .. }) | Err(_) => None,
    };
    if let Some(backend) = backend {
        headers.insert(header::BACKEND, backend.as_str());
    }
    headers.insert(header::CONTENT_TYPE, header::CBOR);
    if let Some(trace) = &envelope.trace {
        trace::insert_headers(&mut headers, trace);
    }
    headers
}

/// The envelope as it goes on the wire: the current span's trace context wins over one the
/// envelope already carries (a re-publish from an untraced context keeps the original).
fn traced(envelope: &Envelope) -> Envelope {
    let mut envelope = envelope.clone();
    if let Some(trace) = trace::current_trace_context() {
        envelope.trace = Some(trace);
    }
    envelope
}

impl Bus {
    async fn send(
        &self,
        subject: &str,
        envelope: &Envelope,
        expect_empty_subject: bool,
    ) -> Result<async_nats::jetstream::publish::PublishAck, (PublishFailure, PublishError)> {
        let envelope = traced(envelope);
        let mut publish = PublishMessage::build()
            .headers(headers_for(subject, &envelope))
            .payload(jr_protocol::encode(&envelope).into());
        if expect_empty_subject {
            publish = publish.expected_last_subject_sequence(0);
        }
        let sent = self.js.send_publish(subject.to_owned(), publish).await;
        let result = match sent {
            Ok(ack) => ack.await,
            Err(error) => Err(error),
        };
        result.map_err(|error| (failure_of(&error), error))
    }

    fn publish_error(
        &self,
        subject: &str,
        failure: PublishFailure,
        error: PublishError,
    ) -> BusError {
        BusMetrics::count(
            &self.metrics.publish_errors,
            vec![("failure", failure.as_str().to_owned())],
        );
        BusError::Publish {
            subject: subject.to_owned(),
            failure,
            source: Box::new(error),
        }
    }

    fn count_published(&self, envelope: &Envelope, outcome: &'static str) {
        BusMetrics::count(
            &self.metrics.published,
            vec![
                ("kind", envelope.kind().as_str().to_owned()),
                ("outcome", outcome.to_owned()),
            ],
        );
    }

    /// Publishes `envelope` on `subject` and waits for the PubAck. `Nats-Msg-Id` = envelope id,
    /// so a repeat within the 10-minute window is reported as `duplicate` and not stored twice.
    #[tracing::instrument(level = "debug", skip(self, envelope), fields(kind = envelope.kind().as_str(), id = %envelope.id))]
    pub async fn publish(
        &self,
        subject: &str,
        envelope: &Envelope,
    ) -> Result<PublishOutcome, BusError> {
        match self.send(subject, envelope, false).await {
            Ok(ack) => {
                self.count_published(
                    envelope,
                    if ack.duplicate {
                        "duplicate"
                    } else {
                        "published"
                    },
                );
                Ok(PublishOutcome {
                    stream_seq: ack.sequence,
                    duplicate: ack.duplicate,
                })
            }
            Err((failure, error)) => Err(self.publish_error(subject, failure, error)),
        }
    }

    /// Publishes a once-only fact: the server stores it only if `subject` holds no message yet
    /// (`Nats-Expected-Last-Subject-Sequence: 0`).
    #[tracing::instrument(level = "debug", skip(self, envelope), fields(kind = envelope.kind().as_str(), id = %envelope.id))]
    pub async fn publish_once(
        &self,
        subject: &str,
        envelope: &Envelope,
    ) -> Result<PublishOnce, BusError> {
        match self.send(subject, envelope, true).await {
            Ok(ack) if ack.duplicate => {
                self.count_published(envelope, "duplicate");
                Ok(PublishOnce::Duplicate { seq: ack.sequence })
            }
            Ok(ack) => {
                self.count_published(envelope, "published");
                Ok(PublishOnce::Published { seq: ack.sequence })
            }
            Err((PublishFailure::WrongLastSequence, _)) => {
                // Ours or someone else's? An earlier attempt of ours whose PubAck was lost (and
                // which fell out of the dedupe window) carries our message id.
                let stream = self.stream_of(subject)?;
                let last = self.last_raw(&stream, subject).await?;
                match last {
                    Some(message) => {
                        let seq = message.sequence;
                        let ours = message
                            .headers
                            .get(async_nats::header::NATS_MESSAGE_ID)
                            .is_some_and(|id| id.as_str() == envelope.id);
                        if ours {
                            self.count_published(envelope, "duplicate");
                            Ok(PublishOnce::Duplicate { seq })
                        } else {
                            self.count_published(envelope, "already-exists");
                            Ok(PublishOnce::AlreadyExists { seq })
                        }
                    }
                    // The message was removed between the two calls (limits); report the race as
                    // already taken rather than publishing a second fact.
                    None => {
                        self.count_published(envelope, "already-exists");
                        Ok(PublishOnce::AlreadyExists { seq: 0 })
                    }
                }
            }
            Err((failure, error)) => Err(self.publish_error(subject, failure, error)),
        }
    }

    /// [`Bus::publish`] retried through transient failures (NATS down or restarting) with
    /// capped exponential backoff until it lands or `shutdown` fires.
    pub async fn publish_retrying(
        &self,
        subject: &str,
        envelope: &Envelope,
        shutdown: &CancellationToken,
    ) -> Result<PublishOutcome, BusError> {
        retry_transient("publish", shutdown, || self.publish(subject, envelope)).await
    }

    /// [`Bus::publish_once`] retried through transient failures.
    pub async fn publish_once_retrying(
        &self,
        subject: &str,
        envelope: &Envelope,
        shutdown: &CancellationToken,
    ) -> Result<PublishOnce, BusError> {
        retry_transient("publish once", shutdown, || {
            self.publish_once(subject, envelope)
        })
        .await
    }

    /// The last message stored on `subject` in `stream`, decoded; `None` if there is none.
    pub async fn last_on_subject(
        &self,
        stream: &str,
        subject: &str,
    ) -> Result<Option<(u64, Envelope)>, BusError> {
        let Some(message) = self.last_raw(stream, subject).await? else {
            return Ok(None);
        };
        let envelope =
            jr_protocol::decode(&message.payload).map_err(|source| BusError::DecodeLast {
                stream: stream.to_owned(),
                subject: subject.to_owned(),
                source,
            })?;
        Ok(Some((message.sequence, envelope)))
    }

    /// The last raw message on `subject`, served by the stream leader so that a fact
    /// acknowledged a moment ago is visible.
    async fn last_raw(
        &self,
        stream: &str,
        subject: &str,
    ) -> Result<Option<StreamMessage>, BusError> {
        let read_error = |transient: bool, source: crate::error::Source| BusError::ReadLast {
            stream: stream.to_owned(),
            subject: subject.to_owned(),
            transient,
            source,
        };
        let handle = self
            .js
            .get_stream_no_info(stream)
            .await
            .map_err(|e| read_error(false, Box::new(e)))?;
        if !self.leader_reads {
            return match handle.direct_get_last_for_subject(subject).await {
                Ok(message) => Ok(Some(message)),
                Err(e) => match e.kind() {
                    DirectGetErrorKind::NotFound => Ok(None),
                    DirectGetErrorKind::InvalidSubject => Err(read_error(false, Box::new(e))),
                    DirectGetErrorKind::ErrorResponse(status, _) if status.is_client_error() => {
                        Err(read_error(false, Box::new(e)))
                    }
                    DirectGetErrorKind::TimedOut
                    | DirectGetErrorKind::Request
                    | DirectGetErrorKind::ErrorResponse(..)
                    | DirectGetErrorKind::Other => Err(read_error(true, Box::new(e))),
                },
            };
        }
        match handle.get_last_raw_message_by_subject(subject).await {
            Ok(message) => Ok(Some(message)),
            Err(e) => match e.kind() {
                LastRawMessageErrorKind::NoMessageFound => Ok(None),
                LastRawMessageErrorKind::Other => Err(read_error(true, Box::new(e))),
                LastRawMessageErrorKind::InvalidSubject | LastRawMessageErrorKind::JetStream(_) => {
                    Err(read_error(false, Box::new(e)))
                }
            },
        }
    }

    fn stream_of(&self, subject: &str) -> Result<String, BusError> {
        let stream = match subject::parse(subject) {
            Ok(ParsedSubject::Assignment { .. }) => jr_protocol::STREAM_ASSIGNMENTS,
            Ok(ParsedSubject::Event { .. }) => jr_protocol::STREAM_EVENTS,
            Ok(ParsedSubject::Command { .. }) => jr_protocol::STREAM_COMMANDS,
            Err(e) => {
                return Err(BusError::ReadLast {
                    stream: String::new(),
                    subject: subject.to_owned(),
                    transient: false,
                    source: Box::new(e),
                });
            }
        };
        Ok(stream.to_owned())
    }
}
