//! Secrets, loaded once at cold start: inline from the environment (local use) or from SSM
//! Parameter Store (SecureString, decrypted). SSM also serves Secrets Manager secrets under
//! `/aws/reference/secretsmanager/<secret-id>`, so one client covers both stores.

use secrecy::SecretString;

#[derive(Clone)]
pub enum SecretSource {
    Inline(SecretString),
    SsmParameter(String),
}

impl std::fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Inline(_) => f.write_str("Inline(<secret>)"),
            Self::SsmParameter(name) => write!(f, "SsmParameter({name})"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("could not load secret from SSM parameter {name}: {reason}")]
pub struct SecretError {
    pub name: String,
    pub reason: String,
}

/// Resolves secrets, creating the SSM client only if some secret needs it.
pub struct SecretLoader<'a> {
    aws: &'a aws_config::SdkConfig,
    ssm: Option<aws_sdk_ssm::Client>,
}

impl<'a> SecretLoader<'a> {
    pub fn new(aws: &'a aws_config::SdkConfig) -> Self {
        Self { aws, ssm: None }
    }

    pub async fn load(&mut self, source: &SecretSource) -> Result<SecretString, SecretError> {
        match source {
            SecretSource::Inline(s) => Ok(s.clone()),
            SecretSource::SsmParameter(name) => {
                let client = self.ssm.get_or_insert_with(|| aws_sdk_ssm::Client::new(self.aws));
                let out = client.get_parameter().name(name).with_decryption(true).send().await.map_err(|e| {
                    SecretError { name: name.clone(), reason: aws_sdk_ssm::error::DisplayErrorContext(&e).to_string() }
                })?;
                out.parameter
                    .and_then(|p| p.value)
                    .map(SecretString::from)
                    .ok_or_else(|| SecretError { name: name.clone(), reason: "parameter has no value".into() })
            }
        }
    }
}
