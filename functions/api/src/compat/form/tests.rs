//! Reading the parameters, multipart bodies above all: what the SDKs send is read whole, and a
//! malformed body is the caller's mistake — a 400 `ERROR_BAD_PARAMETERS`, never a 500.

use base64::Engine;
use relay_shared::testkit::ApiGatewayEvent;

use super::*;

/// A boundary as 2captcha-python's requests (urllib3) makes one: 32 hex digits.
const B: &str = "8c4d7a7e0c4f4d2d9b9e6e0b8d9a4f51";

fn post(ctype: &str, body: &[u8]) -> Request {
    ApiGatewayEvent::new("POST", "/in.php")
        .header("content-type", ctype)
        .body_base64(&base64::engine::general_purpose::STANDARD.encode(body), body.len())
        .build()
}

fn multipart_type(boundary: &str) -> String {
    format!("multipart/form-data; boundary={boundary}")
}

/// A text part as urllib3 and Node's form-data write one.
fn field(boundary: &str, name: &str, value: &[u8]) -> Vec<u8> {
    let mut b = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n").into_bytes();
    b.extend_from_slice(value);
    b.extend_from_slice(b"\r\n");
    b
}

fn closing(boundary: &str) -> Vec<u8> {
    format!("--{boundary}--\r\n").into_bytes()
}

/// The answer to a body that cannot be read: its status, its code and its `error_text`.
async fn refused(req: Request) -> (u16, String, String) {
    let Err(r) = params(&req).await else { panic!("read, not refused") };
    let v: serde_json::Value = serde_json::from_slice(r.body().as_ref()).unwrap_or_default();
    let text = String::from_utf8_lossy(r.body().as_ref()).into_owned();
    match v["request"].as_str() {
        Some(code) => (r.status().as_u16(), code.to_owned(), v["error_text"].as_str().unwrap_or_default().to_owned()),
        None => (r.status().as_u16(), text, String::new()),
    }
}

async fn read(req: Request) -> Params {
    match params(&req).await {
        Ok(p) => p,
        Err(r) => panic!("refused: {} {}", r.status(), String::from_utf8_lossy(r.body().as_ref())),
    }
}

#[tokio::test]
async fn a_file_as_2captcha_python_posts_it_is_read_byte_for_byte_beside_its_fields() {
    let png: &[u8] = b"\x89PNG\r\n\x1a\n\x00\xff\r\n--8c4d7a7e0c4f4d2d9b9e6e0b8d9a4f5 not the boundary\r\n-";
    let mut body = [field(B, "key", b"k"), field(B, "method", b"post"), field(B, "numeric", b"1")].concat();
    body.extend_from_slice(
        format!("--{B}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"captcha.png\"\r\nContent-Type: image/png\r\n\r\n")
            .as_bytes(),
    );
    body.extend_from_slice(png);
    body.extend_from_slice(b"\r\n");
    body.extend_from_slice(&closing(B));
    let p = read(post(&multipart_type(B), &body)).await;
    assert_eq!(p.file.as_deref(), Some(png));
    assert_eq!((p.get("key"), p.get("method"), p.get("numeric")), (Some("k"), Some("post"), Some("1")));
    assert_eq!(p.get("file"), None, "the file is not a text parameter");
}

#[tokio::test]
async fn a_base64_image_sent_as_multipart_fields_is_read_as_the_form_would_be() {
    // Node's form-data: a boundary of dashes and digits; every parameter a text part.
    let boundary = "--------------------------512380923475602781957206";
    let img = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n-image-");
    let body = [
        field(boundary, "key", b"k"),
        field(boundary, "method", b"base64"),
        field(boundary, "body", img.as_bytes()),
        field(boundary, "json", b"1"),
        closing(boundary),
    ]
    .concat();
    let p = read(post(&multipart_type(boundary), &body)).await;
    assert_eq!((p.get("method"), p.get("body")), (Some("base64"), Some(img.as_str())));
    assert!(p.json && p.file.is_none());
}

#[tokio::test]
async fn the_boundary_is_read_as_sent_quoted_or_after_other_parameters_with_a_preamble_and_epilogue() {
    let quoted = "Ab+C/9=x";
    for ctype in [
        format!("multipart/form-data; boundary=\"{quoted}\""),
        format!("Multipart/Form-Data; charset=utf-8; BOUNDARY=\"{quoted}\""),
    ] {
        let mut body = b"a preamble, ignored\r\n".to_vec();
        body.extend([field(quoted, "method", b"post"), closing(quoted)].concat());
        body.extend_from_slice(b"an epilogue, ignored");
        assert_eq!(read(post(&ctype, &body)).await.get("method"), Some("post"), "{ctype}");
    }
    // Only the boundary's exact case delimits.
    let body = [field("abc", "method", b"post"), closing("abc")].concat();
    assert_eq!(refused(post(&multipart_type("ABC"), &body)).await.1, "ERROR_BAD_PARAMETERS");
}

#[tokio::test]
async fn parameters_in_the_body_win_over_the_query_and_an_empty_body_has_none() {
    let body = [field(B, "method", b"post"), closing(B)].concat();
    let req = ApiGatewayEvent::new("POST", "/in.php")
        .query("method=base64&json=1")
        .header("content-type", &multipart_type(B))
        .body(std::str::from_utf8(&body).unwrap_or_default())
        .build();
    let p = read(req).await;
    assert_eq!(p.get("method"), Some("post"));
    assert!(p.json, "json=1 from the query");
    let p = read(post(&multipart_type(B), &closing(B))).await;
    assert!(p.values.is_empty() && p.file.is_none());
    let empty = ApiGatewayEvent::new("POST", "/in.php").header("content-type", "multipart/form-data").build();
    assert!(read(empty).await.values.is_empty(), "no body: no boundary needed");
}

#[tokio::test]
async fn malformed_multipart_bodies_are_a_400_error_bad_parameters_saying_why() {
    let ok_part = field(B, "key", b"k");
    let too_many: Vec<u8> = (0..=MAX_PARTS).flat_map(|i| field(B, &format!("p{i}"), b"v")).chain(closing(B)).collect();
    let cases: Vec<(&str, String, Vec<u8>, &str)> = vec![
        ("no boundary", "multipart/form-data".into(), [ok_part.clone(), closing(B)].concat(), "boundary"),
        ("an empty boundary", "multipart/form-data; boundary=\"\"".into(), closing(B), "boundary"),
        ("a boundary of 71", multipart_type(&"b".repeat(71)), closing(&"b".repeat(71)), "1 to 70"),
        ("an unreadable type", "multipart/form-data; boundary".into(), closing(B), "Content-Type"),
        ("no boundary in the body", multipart_type(B), b"--nothing here".to_vec(), "multipart body"),
        (
            "no closing boundary",
            multipart_type(B),
            format!("--{B}\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nvalue").into_bytes(),
            "multipart body",
        ),
        (
            "no end of the headers",
            multipart_type(B),
            format!("--{B}\r\nContent-Disposition: form-data; name=\"key\"\r\nvalue\r\n--{B}--").into_bytes(),
            "multipart body",
        ),
        (
            "no CRLF after the boundary",
            multipart_type(B),
            format!("--{B}junk\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nv\r\n--{B}--").into_bytes(),
            "multipart body",
        ),
        (
            "a header line that is not a header",
            multipart_type(B),
            format!("--{B}\r\nnot a header\r\n\r\nv\r\n--{B}--").into_bytes(),
            "multipart body",
        ),
        (
            "a part without a name",
            multipart_type(B),
            [format!("--{B}\r\nContent-Disposition: form-data\r\n\r\nv\r\n").into_bytes(), closing(B)].concat(),
            "without a name",
        ),
        (
            "a part without Content-Disposition",
            multipart_type(B),
            [format!("--{B}\r\nContent-Type: text/plain\r\n\r\nv\r\n").into_bytes(), closing(B)].concat(),
            "without a name",
        ),
        (
            "a field that is not UTF-8",
            multipart_type(B),
            [field(B, "method", b"p\xffst"), closing(B)].concat(),
            "part `method` is not UTF-8",
        ),
        ("101 parts", multipart_type(B), too_many, "more than 100 parts"),
    ];
    for (what, ctype, body, says) in cases {
        let (status, code, text) = refused(post(&ctype, &body)).await;
        assert_eq!((status, code.as_str()), (400, "ERROR_BAD_PARAMETERS"), "{what}");
        // Plain answers are the code alone; with json=1 the reason comes too.
        let req = ApiGatewayEvent::new("POST", "/in.php")
            .query("json=1")
            .header("content-type", &ctype)
            .body_base64(&base64::engine::general_purpose::STANDARD.encode(&body), body.len())
            .build();
        let (status, code, text_json) = refused(req).await;
        assert_eq!((status, code.as_str()), (400, "ERROR_BAD_PARAMETERS"), "{what} (json)");
        assert!(text.is_empty() && text_json.contains(says), "{what}: {text_json:?}");
    }
    // A hundred parts are fine.
    let hundred: Vec<u8> = (0..MAX_PARTS).flat_map(|i| field(B, &format!("p{i}"), b"v")).chain(closing(B)).collect();
    assert_eq!(read(post(&multipart_type(B), &hundred)).await.values.len(), MAX_PARTS);
}

#[tokio::test]
async fn a_body_over_the_bound_is_refused_before_it_is_parsed() {
    let body = [field(B, "body", &vec![b'A'; MAX_BODY]), closing(B)].concat();
    let (status, code, _) = refused(post(&multipart_type(B), &body)).await;
    assert_eq!((status, code.as_str()), (413, "ERROR_TOO_BIG_CAPTCHA_FILESIZE"));
}
