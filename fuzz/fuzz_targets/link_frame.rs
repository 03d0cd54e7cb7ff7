//! The lane's frame decoder (the sidecar's TCP and shared-memory links, from any peer): any
//! bytes are a request or a reply or an error, never a panic or an allocation past the bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use moelane_engine::tier::{ColdReply, ColdRequest};

fuzz_target!(|data: &[u8]| {
    let mut req = ColdRequest::default();
    if moelane_link::frame::decode_request(data, &mut req).is_ok() {
        // what decodes encodes back to a frame that decodes to the same bits (compared as
        // frames: a NaN activation is not equal to itself)
        let mut buf = Vec::new();
        moelane_link::frame::encode_request(&req, &mut buf);
        let mut again = ColdRequest::default();
        moelane_link::frame::decode_request(&buf, &mut again).expect("re-decode");
        let mut buf2 = Vec::new();
        moelane_link::frame::encode_request(&again, &mut buf2);
        assert_eq!(buf, buf2);
    }
    let mut rep = ColdReply::default();
    let _ = moelane_link::frame::decode_reply(data, &mut rep);
    let _ = moelane_link::reply_from("fuzz", data);
});
