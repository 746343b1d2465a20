//! Wire sanity checks of Gitea's runner protocol: message encodings and the Connect error shape.

use jr_forge::Code;
use jr_forge::proto::ping::v1::PingRequest;
use jr_forge::proto::runner::v1::{
    FetchTaskRequest, Result as TaskResult, TaskState, UpdateLogResponse,
};
use prost::Message;

#[test]
fn fetch_task_request_with_version_five_encodes_to_08_05() {
    assert_eq!(
        FetchTaskRequest {
            tasks_version: 5,
            ..Default::default()
        }
        .encode_to_vec(),
        vec![0x08, 0x05]
    );
}

#[test]
fn update_log_response_ack_300_encodes_to_08_ac_02() {
    assert_eq!(
        UpdateLogResponse { ack_index: 300 }.encode_to_vec(),
        vec![0x08, 0xac, 0x02]
    );
}

#[test]
fn empty_messages_encode_to_zero_bytes_and_decode_back() {
    assert!(FetchTaskRequest::default().encode_to_vec().is_empty());
    assert!(PingRequest::default().encode_to_vec().is_empty());
    let decoded = FetchTaskRequest::decode(&[][..]).expect("empty body is a valid message");
    assert_eq!(decoded.tasks_version, 0);
}

#[test]
fn task_state_result_uses_protocol_enum_numbers() {
    let state = TaskState {
        id: 1,
        result: TaskResult::Cancelled as i32,
        ..Default::default()
    };
    // field 1 varint 1, field 2 varint 3
    assert_eq!(state.encode_to_vec(), vec![0x08, 0x01, 0x10, 0x03]);
}

#[test]
fn http_statuses_follow_the_current_connect_spec() {
    let expected = [
        (Code::Canceled, 499),
        (Code::Unknown, 500),
        (Code::InvalidArgument, 400),
        (Code::DeadlineExceeded, 504),
        (Code::NotFound, 404),
        (Code::AlreadyExists, 409),
        (Code::PermissionDenied, 403),
        (Code::ResourceExhausted, 429),
        (Code::FailedPrecondition, 400),
        (Code::Aborted, 409),
        (Code::OutOfRange, 400),
        (Code::Unimplemented, 501),
        (Code::Internal, 500),
        (Code::Unavailable, 503),
        (Code::DataLoss, 500),
        (Code::Unauthenticated, 401),
    ];
    assert_eq!(expected.len(), Code::ALL.len());
    for (code, status) in expected {
        assert_eq!(code.http_status(), status, "{code}");
    }
}
