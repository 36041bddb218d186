//! Prints a GGUF file's metadata (arrays abbreviated) and tensor directory.
//! `cargo run -p harness-s-native --example gguf_info -- model.gguf`
fn main() -> Result<(), native::NativeError> {
    let path = std::env::args().nth(1).expect("usage: gguf_info FILE.gguf");
    let f = native::gguf::GgufFile::open(std::path::Path::new(&path))?;
    for (k, v) in &f.metadata {
        match v.as_array() {
            Some(a) => println!("{k} = [{} items]", a.len()),
            None => println!("{k} = {v:?}"),
        }
    }
    for t in f.tensors.values() {
        println!("{} {:?} {}", t.name, t.shape, t.kind.name());
    }
    Ok(())
}
