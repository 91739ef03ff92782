//! The table's shape, as `template.yaml` declares it, for tests and local mode.

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection, ProjectionType,
    ScalarAttributeType, TimeToLiveSpecification,
};

use super::{Client, DELIVERY_INDEX, DUE_INDEX, QUEUE_INDEX, StoreError, attr, sdk_error};

/// The table's sparse indexes: name, hash key and its type, range key (a number),
/// projection.
fn indexes() -> [(&'static str, (&'static str, ScalarAttributeType), &'static str, ProjectionType); 3] {
    use ScalarAttributeType::{N, S};
    [
        (DUE_INDEX, (attr::POLL_SHARD, N), attr::POLL_DUE_AT, ProjectionType::All),
        (DELIVERY_INDEX, (attr::DLV_SHARD, N), attr::DLV_DUE, ProjectionType::KeysOnly),
        (QUEUE_INDEX, (attr::SQ_KEY, S), attr::SQ_AT, ProjectionType::KeysOnly),
    ]
}

fn gsi(name: &str, hash: &str, range: &str, projection: ProjectionType) -> Result<GlobalSecondaryIndex, StoreError> {
    GlobalSecondaryIndex::builder()
        .index_name(name)
        .key_schema(key(hash, KeyType::Hash)?)
        .key_schema(key(range, KeyType::Range)?)
        .projection(Projection::builder().projection_type(projection).build())
        .build()
        .map_err(|e| StoreError::Rejected(e.to_string()))
}

/// Adds the indexes a table made by an earlier version lacks (local mode's data directory
/// outlives upgrades). One UpdateTable per missing index.
pub async fn migrate(client: &Client, table: &str) -> Result<Vec<&'static str>, StoreError> {
    let out = client.describe_table().table_name(table).send().await.map_err(sdk_error)?;
    let have: Vec<String> = out
        .table
        .and_then(|t| t.global_secondary_indexes)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|i| i.index_name)
        .collect();
    let mut added = Vec::new();
    for (index, (hash, hash_type), range, projection) in indexes() {
        if have.iter().any(|h| h == index) {
            continue;
        }
        let create = aws_sdk_dynamodb::types::CreateGlobalSecondaryIndexAction::builder()
            .index_name(index)
            .key_schema(key(hash, KeyType::Hash)?)
            .key_schema(key(range, KeyType::Range)?)
            .projection(Projection::builder().projection_type(projection).build())
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))?;
        client
            .update_table()
            .table_name(table)
            .attribute_definitions(def(hash, hash_type)?)
            .attribute_definitions(def(range, ScalarAttributeType::N)?)
            .global_secondary_index_updates(
                aws_sdk_dynamodb::types::GlobalSecondaryIndexUpdate::builder().create(create).build(),
            )
            .send()
            .await
            .map_err(sdk_error)?;
        added.push(index);
    }
    Ok(added)
}

fn key(name: &str, t: KeyType) -> Result<KeySchemaElement, StoreError> {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(t)
        .build()
        .map_err(|e| StoreError::Rejected(e.to_string()))
}

fn def(name: &str, t: ScalarAttributeType) -> Result<AttributeDefinition, StoreError> {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(t)
        .build()
        .map_err(|e| StoreError::Rejected(e.to_string()))
}

/// Creates the task table with its indexes and TTL.
pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
    let mut req = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(def(attr::PK, ScalarAttributeType::S)?)
        .key_schema(key(attr::PK, KeyType::Hash)?);
    for (index, (hash, hash_type), range, projection) in indexes() {
        req = req
            .attribute_definitions(def(hash, hash_type)?)
            .attribute_definitions(def(range, ScalarAttributeType::N)?)
            .global_secondary_indexes(gsi(index, hash, range, projection)?);
    }
    req.send().await.map_err(sdk_error)?;
    client
        .update_time_to_live()
        .table_name(table)
        .time_to_live_specification(
            TimeToLiveSpecification::builder()
                .enabled(true)
                .attribute_name(attr::EXPIRES_TTL)
                .build()
                .map_err(|e| StoreError::Rejected(e.to_string()))?,
        )
        .send()
        .await
        .map_err(sdk_error)?;
    Ok(())
}
